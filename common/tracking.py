"""Optional experiment tracking beside metrics.jsonl (which stays the source of truth): --log-to none | wandb |
tensorboard. Rank 0 only; offline-safe (wandb runs in offline mode unless $WANDB_MODE says otherwise); a missing
package is a one-line error naming it, before any model loads."""
import os
import sys

LOG_TO = ("none", "wandb", "tensorboard")
PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard"}


def add_log_to_arg(group):
    group.add_argument("--log-to", default="none", choices=LOG_TO, help="also log every metrics line to wandb "
                       "(offline unless $WANDB_MODE is set) or tensorboard (<out>/tensorboard); optional packages")


class Tracker:
    """log(metrics) once per metrics line (its "update" or "step" is the x axis), close() at the end."""

    def __init__(self, log_to, out, config, rank=0):
        self.kind, self.run = (log_to if rank == 0 else "none"), None
        try:
            if self.kind == "wandb":
                os.environ.setdefault("WANDB_MODE", "offline")
                import wandb
                self.run = wandb.init(dir=out, config=config, name=os.path.basename(os.path.abspath(out)))
            elif self.kind == "tensorboard":
                import tensorboard  # noqa: F401 (torch's writer needs it)
                from torch.utils.tensorboard import SummaryWriter
                self.run = SummaryWriter(os.path.join(out, "tensorboard"))
        except ImportError:
            sys.exit(f"--log-to {log_to}: the optional package {PACKAGES[log_to]!r} is not installed "
                     f"(pip install {PACKAGES[log_to]}), or use --log-to none")

    def log(self, metrics):
        if self.run is None:
            return
        step = metrics.get("update", metrics.get("step"))
        values = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.kind == "wandb":
            self.run.log(values, step=step)
        else:
            for k, v in values.items():
                self.run.add_scalar(k, v, step)

    def close(self):
        if self.run is not None:
            self.run.finish() if self.kind == "wandb" else self.run.close()
