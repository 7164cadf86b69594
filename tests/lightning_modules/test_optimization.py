"""The Transformer's inverse-square-root schedule and torch's per-batch ones (OneCycle, cyclic)
stepped per optimizer step, a OneCycle sized to the fit; the plateau step taken at the
validation that ends an epoch."""

import functools
from types import SimpleNamespace

import pytest
import torch

from lightning_modules.errors import ModelConfigError
from lightning_modules.optimization import (
    InverseSquareRootLR,
    configure_optimizers,
    step_plateau_schedulers,
)

OneCycleLR = torch.optim.lr_scheduler.OneCycleLR


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


def cli_scheduler(*args: str):
    """``model.scheduler`` as LightningCLI gives it: jsonargparse's factory (a partial)."""
    from jsonargparse import ArgumentParser
    from lightning.pytorch.cli import LRSchedulerCallable

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--scheduler", type=LRSchedulerCallable)
    return parser.instantiate_classes(parser.parse_args(["--scheduler", *args])).scheduler


def test_torchs_per_batch_schedules_step_every_optimizer_step():
    # OneCycleLR and CyclicLR step after every batch (their docs); stepped per epoch, a
    # OneCycle sized to the run's steps never left its warm-up
    params = [torch.nn.Parameter(torch.zeros(1))]
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    one_cycle = cli_scheduler(
        "torch.optim.lr_scheduler.OneCycleLR", "--scheduler.max_lr", "0.1",
        "--scheduler.total_steps", "10",
    )  # fmt: skip
    cyclic = functools.partial(torch.optim.lr_scheduler.CyclicLR, base_lr=0.01, max_lr=0.1)
    for factory in (one_cycle, cyclic):
        assert configure_optimizers(params, sgd, factory)["lr_scheduler"]["interval"] == "step"
    cosine = functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=5)
    assert configure_optimizers(params, sgd, cosine)["lr_scheduler"]["interval"] == "epoch"


def test_a_one_cycle_without_total_steps_is_sized_to_the_fit():
    params = [torch.nn.Parameter(torch.zeros(1))]
    adam = torch.optim.Adam
    one_cycle = cli_scheduler("torch.optim.lr_scheduler.OneCycleLR", "--scheduler.max_lr", "0.1")

    def total(factory, trainer) -> int:
        return configure_optimizers(params, adam, factory, trainer=trainer)["lr_scheduler"][
            "scheduler"
        ].total_steps

    # the data module's exact count where it has one (variable windows), else Lightning's
    exact = SimpleNamespace(stepping_batches=lambda trainer: 123)
    trainer = SimpleNamespace(datamodule=exact, estimated_stepping_batches=120)
    assert total(one_cycle, trainer) == 123
    assert total(one_cycle, SimpleNamespace(datamodule=None, estimated_stepping_batches=77)) == 77
    assert total(functools.partial(OneCycleLR, max_lr=0.1), trainer) == 123  # a plain partial
    given = cli_scheduler(
        "torch.optim.lr_scheduler.OneCycleLR", "--scheduler.max_lr", "0.1",
        "--scheduler.total_steps", "9",
    )  # fmt: skip
    assert total(given, trainer) == 9
    endless = SimpleNamespace(datamodule=None, estimated_stepping_batches=float("inf"))
    for trainer in (None, endless):
        with pytest.raises(ModelConfigError, match="OneCycleLR needs the run's length"):
            configure_optimizers(params, adam, one_cycle, trainer=trainer)


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam])
def test_float16_weights_refuse_an_adam_style_optimizer_whose_eps_is_zero_there(optimizer):
    """What 16-true does to Adam: its state in float16, the first step makes the weights inf
    (the check has a reason); refused before any step, other precisions and SGD are not."""
    param = torch.nn.Parameter(torch.randn(8, dtype=torch.float16))
    doomed = optimizer([param], lr=2e-3)
    param.grad = torch.full_like(param, 1e-3)
    doomed.step()
    assert not torch.isfinite(param).any()
    params = [torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))]
    with pytest.raises(ModelConfigError, match=r"16-true keeps the weights and .* use 16-mixed"):
        configure_optimizers(params, optimizer, None, "16-true")
    for precision in ("16-mixed", "bf16-true", "32-true", None):
        configure_optimizers(params, optimizer, None, precision)
    configure_optimizers(params, lambda p: optimizer(p, eps=1e-3), None, "16-true")
    configure_optimizers(params, lambda p: torch.optim.SGD(p, lr=1.0), None, "16-true")


def plateau_fit(epoch: int, last_batch: bool, frequency: int = 1):
    """A module in a fit at the end of a validation: a plateau scheduler stepped every
    ``frequency`` epochs and a step-interval one; the steps it is given are recorded."""
    configs = [
        SimpleNamespace(scheduler="plateau", reduce_on_plateau=True, interval="epoch",
                        frequency=frequency, monitor="val/loss"),
        SimpleNamespace(scheduler="warmup", reduce_on_plateau=False, interval="step",
                        frequency=1, monitor=None),
    ]  # fmt: skip
    progress = SimpleNamespace(is_last_batch=last_batch, current=SimpleNamespace(ready=3))
    trainer = SimpleNamespace(
        current_epoch=epoch, lr_scheduler_configs=configs, num_training_batches=6,
        callback_metrics={"val/loss": torch.tensor(2.5)},
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
    )  # fmt: skip
    steps = []

    def lr_scheduler_step(scheduler: str, value: torch.Tensor) -> None:
        steps.append((scheduler, float(value)))

    module = SimpleNamespace(trainer=trainer, automatic_optimization=True,
                             lr_scheduler_step=lr_scheduler_step)  # fmt: skip
    return module, steps


def test_the_validation_that_ends_an_epoch_takes_its_plateau_step():
    # (Lightning's own step comes after on_train_epoch_end, where ModelCheckpoint saves)
    module, steps = plateau_fit(epoch=0, last_batch=True)
    assert step_plateau_schedulers(module) is True
    assert steps == [("plateau", 2.5)]
    # a validation inside the epoch (val_check_interval) leaves it to the epoch's end
    module, steps = plateau_fit(epoch=0, last_batch=False)
    assert step_plateau_schedulers(module) is False and steps == []
    # an epoch its frequency skips
    module, steps = plateau_fit(epoch=0, last_batch=True, frequency=2)
    assert step_plateau_schedulers(module) is True and steps == []
    module, steps = plateau_fit(epoch=1, last_batch=True, frequency=2)
    assert step_plateau_schedulers(module) is True and steps == [("plateau", 2.5)]


def test_asgd_keeps_its_state_on_an_accelerator_and_cpus_as_they_are():
    # meta tensors stand in for a GPU's (capturable refuses CPU tensors); SGD is left alone
    def build(optimizer, device):
        params = [torch.nn.Parameter(torch.zeros(3, device=device))]
        return configure_optimizers(params, optimizer, None)

    asgd = functools.partial(torch.optim.ASGD, lr=30.0, lambd=0.0, t0=1e12)
    assert build(asgd, "meta").param_groups[0]["capturable"] is True
    assert build(asgd, "cpu").param_groups[0]["capturable"] is False
    sgd = build(functools.partial(torch.optim.SGD, lr=1.0), "meta")
    assert "capturable" not in sgd.param_groups[0]


@pytest.mark.gpu
def test_asgd_on_cuda_steps_without_reading_back_and_as_on_a_cpu():
    """AWD-LSTM's optimizer on a GPU: no blocking read in its steps (averaging from step 3),
    the weights and their average those of the CPU's (float64) steps."""
    asgd = functools.partial(torch.optim.ASGD, lr=0.5, lambd=0.0, t0=3.0, weight_decay=1e-3)
    torch.manual_seed(0)
    start, grads = torch.randn(5, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    results = []
    for device in ("cpu", "cuda"):
        param = torch.nn.Parameter(start.to(device))
        optimizer = configure_optimizers([param], asgd, None)
        torch.cuda.set_sync_debug_mode("error" if device == "cuda" else "default")
        try:
            for grad in grads:
                param.grad = grad.to(device)
                optimizer.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results.append((param.detach().cpu(), optimizer.state[param]["ax"].cpu()))
    (cpu_param, cpu_ax), (gpu_param, gpu_ax) = results
    torch.testing.assert_close(gpu_param, cpu_param)
    torch.testing.assert_close(gpu_ax, cpu_ax)
