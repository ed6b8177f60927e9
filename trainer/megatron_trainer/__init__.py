"""The trainer: one agent per pod (control endpoint, supervision, heartbeats) and one worker per GPU
(Megatron-Core training that reconfigures in place when a new MeshPlan arrives)."""
