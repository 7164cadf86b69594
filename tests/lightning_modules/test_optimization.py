"""The Transformer's inverse-square-root schedule, stepped per optimizer step."""

import pytest
import torch

from lightning_modules.optimization import InverseSquareRootLR, configure_optimizers


def test_warm_up_then_inverse_square_root():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.Adam([param], lr=1e-3)
    schedule = InverseSquareRootLR(optimizer, warmup_steps=4)
    seen = []
    for _ in range(16):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    expected = [1e-3 * min(s / 4, (4 / s) ** 0.5) for s in range(1, 17)]
    assert seen == pytest.approx(expected)
    assert max(seen) == pytest.approx(1e-3) and seen.index(max(seen)) == 3


def test_configure_optimizers_steps_it_every_step_and_plateau_every_epoch():
    params = [torch.nn.Parameter(torch.zeros(1))]
    adam = torch.optim.Adam
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    step = configure_optimizers(params, adam, lambda o: InverseSquareRootLR(o, 10))
    epoch = configure_optimizers(params, adam, plateau)
    assert step["lr_scheduler"]["interval"] == "step"
    assert epoch["lr_scheduler"]["interval"] == "epoch"
    with pytest.raises(ValueError, match="warmup_steps"):
        InverseSquareRootLR(torch.optim.Adam(params), 0)
