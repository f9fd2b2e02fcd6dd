"""The chaos benchmark's job (bench/chaos.py): tests.tasks.SlowBlobTask's MLP and blobs, paced by a sleep of
`step_s` in every step's loss, with no evaluation; the plain loop (bench/chaos_plain.py) trains the same model on
the same data at the same pace."""

from __future__ import annotations

from torch.utils.data import Dataset

from tests.tasks import SlowBlobTask


class ChaosTask(SlowBlobTask):
    """SlowBlobTask without evaluation: 400 samples, 8 features, dropout; one sample per rank per step on 4 ranks
    makes an epoch 100 steps (the default checkpoint's cadence, as in issue 44's measurements)."""

    def __init__(self, size: int = 400, step_s: float = 0.2, **kwargs: object) -> None:
        super().__init__(size=size, step_s=step_s, batch_norm=False, **kwargs)  # type: ignore[arg-type]

    def eval_dataset(self) -> Dataset:
        return None  # type: ignore[return-value]  # no evaluation (mgpu.Task's contract allows None)
