"""Names that operator, trainer, CRD and chart must agree on. Change them in one place only."""

from __future__ import annotations

GROUP = "megatron.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "MegatronJob"
PLURAL = "megatronjobs"
SINGULAR = "megatronjob"
SHORT_NAMES = ("mj", "mjob")

# Labels on every child object of a job.
LABEL_JOB = f"{GROUP}/job"
LABEL_ROLE = f"{GROUP}/role"  # "worker" or "spare"
LABEL_REPLICA = f"{GROUP}/replica"  # data-parallel replica index of a worker pod
LABEL_POD_INDEX = f"{GROUP}/pod-index"  # position of a pod inside its replica
ROLE_WORKER = "worker"
ROLE_SPARE = "spare"
ROLE_RETIRED = "retired"  # a surplus pod the operator is deleting: its going is no failure

# The trainer agent's control endpoint (one per pod).
AGENT_PORT = 29400
AGENT_PLAN_PATH = "/v1/plan"
AGENT_STATE_PATH = "/v1/state"
AGENT_HEALTH_PATH = "/healthz"
AGENT_METRICS_PATH = "/metrics"
# How long an agent keeps the operator's idle connection open: the operator pushes every plan
# over the connection of the last push (opening thousands of connections costs more than the pushes).
AGENT_KEEPALIVE_SECONDS = 3600.0

# The operator's endpoint for agent reports (heartbeats, failed peers).
OPERATOR_REPORT_PORT = 29500
OPERATOR_REPORT_PATH = "/v1/reports"

# Rendezvous (torch TCPStore) port on the pod that hosts the store.
RENDEZVOUS_PORT = 29401

# Secret holding the per-job bearer token; key inside it.
TOKEN_SECRET_KEY = "token"
AUTH_HEADER = "Authorization"
AUTH_SCHEME = "Bearer"

# Largest plan or report body either side accepts (a 4096-pod plan is ~1 MB).
MAX_BODY_BYTES = 8 * 1024 * 1024

# Environment of trainer pods, set by the operator and read in one place by the agent.
ENV_JOB_NAME = "MEGATRON_JOB_NAME"
ENV_JOB_NAMESPACE = "MEGATRON_JOB_NAMESPACE"
ENV_JOB_UID = "MEGATRON_JOB_UID"
ENV_JOB_TOKEN = "MEGATRON_JOB_TOKEN"
ENV_POD_NAME = "MEGATRON_POD_NAME"
ENV_POD_IP = "MEGATRON_POD_IP"
ENV_POD_ROLE = "MEGATRON_POD_ROLE"
ENV_OPERATOR_URL = "MEGATRON_OPERATOR_URL"
ENV_GPUS_PER_POD = "MEGATRON_GPUS_PER_POD"
ENV_JOB_SPEC = "MEGATRON_JOB_SPEC"  # the whole MegatronJobSpec as JSON: spec.to_wire()
ENV_HEARTBEAT_INTERVAL = "MEGATRON_HEARTBEAT_INTERVAL_SECONDS"
#: Every variable above: the operator owns them, a job may not set them (spec.env, spec.template).
OPERATOR_ENV = (
    ENV_JOB_NAME,
    ENV_JOB_NAMESPACE,
    ENV_JOB_UID,
    ENV_JOB_TOKEN,
    ENV_POD_NAME,
    ENV_POD_IP,
    ENV_POD_ROLE,
    ENV_OPERATOR_URL,
    ENV_GPUS_PER_POD,
    ENV_JOB_SPEC,
    ENV_HEARTBEAT_INTERVAL,
)

# Trainer pods: the container the operator builds (a container of spec.template by this name is
# merged into it), and the node label every node carries, the smallest failure domain.
TRAINER_CONTAINER = "trainer"
HOSTNAME_TOPOLOGY_KEY = "kubernetes.io/hostname"

# Every agent hosts a TCPStore server on RENDEZVOUS_PORT at its pod address (the agent outlives its
# workers; a worker must never host the store: it may die, and a TCPStore port cannot be re-bound
# while its server lives). A plan names the store of a
# surviving member pod; the epoch's keys live under MeshPlan.rendezvous.storePrefix.
