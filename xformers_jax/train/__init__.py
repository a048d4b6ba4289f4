"""Training: train state, optimizers and schedules, the jitted step, orbax checkpoints,
metrics (JSONL, TensorBoard, a progress bar), dynamic loss scaling, tasks, the run record and
workdir lock, and the loop behind ``xformers_jax_experiments/train.py``."""

from ._checkpoint import CheckpointCorrupt as CheckpointCorrupt
from ._checkpoint import Checkpointer as Checkpointer
from ._compress import Compression as Compression
from ._compress import restore_model as restore_model
from ._compress import state_dir as state_dir
from ._config import PRECISIONS as PRECISIONS
from ._config import base_config as base_config
from ._config import model_config as model_config
from ._config import set_model_kind as set_model_kind
from ._config import validate_config as validate_config
from ._lock import WorkdirLock as WorkdirLock
from ._lock import WorkdirLocked as WorkdirLocked
from ._loop import evaluate as evaluate
from ._loop import train_and_evaluate as train_and_evaluate
from ._loss_scale import DynamicLossScale as DynamicLossScale
from ._loss_scale import LossScaleState as LossScaleState
from ._metrics import IntervalMean as IntervalMean
from ._metrics import MetricWriter as MetricWriter
from ._metrics import read_jsonl as read_jsonl
from ._optim import make_optimizer as make_optimizer
from ._optim import make_schedule as make_schedule
from ._progress import ProgressBar as ProgressBar
from ._record import ConfigChanged as ConfigChanged
from ._record import RunRecord as RunRecord
from ._record import config_json as config_json
from ._sharding import ShardingPlan as ShardingPlan
from ._sharding import make_sharding_plan as make_sharding_plan
from ._sharding import resolve_mesh as resolve_mesh
from ._state import TrainState as TrainState
from ._state import create_train_state as create_train_state
from ._step import make_eval_step as make_eval_step
from ._step import make_train_step as make_train_step
from ._tasks import TASKS as TASKS
from ._tasks import Task as Task
from ._tasks import TaskSpec as TaskSpec
from ._objective import forward as forward
from ._objective import make_loss_fn as make_loss_fn
from ._objective import make_metrics_fn as make_metrics_fn
from ._tasks import build_model as build_model
from ._tasks import make_task as make_task
from ._tasks import register_task as register_task
