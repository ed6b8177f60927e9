"""The training worker: one process per GPU (or CPU slot) that trains a Megatron-Core GPT and
reconfigures in place when the agent assigns a new :class:`~megatron_contract.mesh.MeshPlan`.

The process is :class:`.runtime.Worker`: its threads and the state they share. Its main thread
enters each plan's epoch (:mod:`.epoch_entry`) and trains in it (:mod:`.training_loop`); its
watchdog and channel reader interrupt the epoch (:mod:`.progress_watch`).

Stages of one reconfiguration, each in its own module, composed by :mod:`.epoch_entry`:

- :mod:`.abort`: abort every communicator of the old epoch and drop every object that holds one;
- :mod:`.rendezvous`: join the epoch's process groups (TCPStore client + prefix) and Megatron's
  ``parallel_state``; spares hold a fake, communicator-free world instead;
- :mod:`.model`: build GPT, DDP wrapper and optimizer for the current groups; hand state over;
- :mod:`.peer_restore` / :mod:`.checkpoint`: restore state from a DP peer or a checkpoint;
  :mod:`.checkpoint` also saves asynchronously; :mod:`.checkpoint_files` holds a checkpoint's
  manifest, verification and retention, :mod:`.writer_processes` the writer's helper processes;
- :mod:`.verify`: the group agrees on step and checksum before training resumes;
- :mod:`.lifecycle`: the worker's states and the transitions allowed between them.

Entry point: ``python -m megatron_trainer.worker --channel-fd FD --local-rank I``.
"""
