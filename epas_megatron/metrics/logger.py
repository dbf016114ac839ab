"""Where metrics go: ``metrics.jsonl`` (always), TensorBoard (default on) and wandb (opt-in).

Only the logging rank (global rank 0) writes. ``metrics.jsonl`` holds one JSON object per line:
periodic training records (``iteration``, ``lm_loss``, ``lr``, ``grad_norm``, ``tokens_per_s``,
...), validation records (``"kind": "valid"``) and events such as EPAS switches
(``"kind": "switch"``). The file is opened in append mode and flushed per line, so a resumed run
continues it and a crash loses nothing written.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional, Sequence


def _jsonable(value: Any):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


class MetricsLogger:
    """metrics.jsonl + TensorBoard + wandb on the logging rank; no-ops elsewhere."""

    def __init__(
        self,
        output_dir: str | os.PathLike,
        *,
        enabled: bool,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str = "epas-megatron",
        wandb_run_name: Optional[str] = None,
        config: Optional[dict] = None,
    ):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(out / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(out / "tensorboard"))
        if wandb:
            import wandb as wandb_lib

            self._wandb = wandb_lib.init(
                project=wandb_project,
                name=wandb_run_name or out.name,
                dir=str(out),
                config=config or {},
                resume="allow",
            )

    def log(self, record: dict[str, Any], step: int, prefix: str = "train", scalars: Optional[Sequence[str]] = None,
            to_jsonl: bool = True) -> None:
        """Write one record; its numeric fields (those named in ``scalars``, default all) also go
        to TensorBoard/wandb under ``prefix/``. ``to_jsonl=False``: TensorBoard/wandb only (a
        second name for a series already in metrics.jsonl)."""
        if not self.enabled:
            return
        if to_jsonl:
            self._jsonl.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
        numeric = {
            f"{prefix}/{k}": v
            for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iteration"
            and (scalars is None or k in scalars)
        }
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None and numeric:
            self._wandb.log(numeric, step=step)

    def close(self) -> None:
        """Flush and close every sink."""
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._jsonl = self._tb = self._wandb = None
