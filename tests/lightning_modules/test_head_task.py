"""HeadTask: what every task shares (head setup, checkpoint checks)."""

from types import SimpleNamespace

import pytest
import torch

from heads import SoftmaxHead
from heads.errors import CheckpointMismatchError
from lightning_modules import LanguageModel
from lightning_modules.backbones import LSTMBackbone


def model(head=None) -> LanguageModel:
    return LanguageModel(LSTMBackbone(30, 8, 8), head or SoftmaxHead(8, 30))


class FakeStrategy:
    def __init__(self) -> None:
        self.broadcasts = []

    def broadcast(self, obj, src=0):
        self.broadcasts.append(obj)
        return "rank 0's decision"


@pytest.mark.parametrize("rank", [0, 1])
def test_decide_once_runs_on_rank_zero_only_and_broadcasts(rank):
    task = model()
    strategy = FakeStrategy()
    task._trainer = SimpleNamespace(world_size=2, is_global_zero=rank == 0, strategy=strategy)
    calls = []

    def decide():
        calls.append(rank)
        return "decided here"

    assert task._decide_once(decide) == "rank 0's decision"
    assert calls == ([0] if rank == 0 else [])
    assert strategy.broadcasts == (["decided here"] if rank == 0 else [None])


def test_decide_once_without_ddp_just_decides():
    task = model()
    task._trainer = SimpleNamespace(world_size=1)
    assert task._decide_once(lambda: 42) == 42


class FakeData:
    def __init__(self) -> None:
        self.loaded = []

    def load_state_dict(self, state) -> None:
        self.loaded.append(state)


def test_loading_restores_the_data_once_and_checks_the_head_first():
    task, data = model(), FakeData()
    task._trainer = SimpleNamespace(datamodule=data, state=SimpleNamespace(fn="validate"))
    checkpoint = {"state_dict": task.state_dict(), "FakeData": {"vocab": "v"}}
    task.on_save_checkpoint(checkpoint)
    task.on_load_checkpoint(checkpoint)
    assert data.loaded == [{"vocab": "v"}]
    assert "FakeData" not in checkpoint  # Lightning will not restore it a second time
    other = model(SoftmaxHead(8, 30, bias=False))
    other._trainer = SimpleNamespace(datamodule=None)
    with pytest.raises(CheckpointMismatchError, match=r"unexpected \['bias'\]"):
        other.on_load_checkpoint({"state_dict": task.state_dict()})
    checkpoint["head_class"] = "heads.mos.MoSHead"
    with pytest.raises(CheckpointMismatchError, match="trained with MoSHead, not SoftmaxHead"):
        task.on_load_checkpoint(checkpoint)


def test_a_missing_pretrained_checkpoint_is_named(tmp_path):
    from lightning_modules.errors import CheckpointPathError

    with pytest.raises(CheckpointPathError, match="pretrained_checkpoint"):
        LanguageModel(LSTMBackbone(30, 8, 8), SoftmaxHead(8, 30),
                      pretrained_checkpoint=str(tmp_path / "none.ckpt"))  # fmt: skip
    assert torch.isfinite(model().head.weight).all()


def test_loss_backend_reaches_the_head_and_is_checked():
    from heads.errors import HeadConfigError

    task = LanguageModel(LSTMBackbone(30, 8, 8), SoftmaxHead(8, 30), loss_backend="torch")
    assert task.head.loss_options.backend == "torch"
    assert model().head.loss_options.backend == "auto"
    with pytest.raises(HeadConfigError, match="loss_backend 'fastest' is not one of") as raised:
        LanguageModel(LSTMBackbone(30, 8, 8), SoftmaxHead(8, 30), loss_backend="fastest")
    assert "liger" in str(raised.value) and "rows" in str(raised.value)


@pytest.mark.parametrize("plan", ["eager", "compiled", "rows", "plain", "checkpoint"])
def test_a_plan_named_as_loss_backend_runs_on_the_torch_backend(plan):
    """One config line picks how the loss runs (``model.loss_backend: rows``), on any
    device: the measured table (``auto``) is not consulted."""
    task = LanguageModel(LSTMBackbone(30, 8, 8), SoftmaxHead(8, 30), loss_backend=plan)
    for device in ("cuda", "cpu"):  # a property of the device: no CUDA needed
        task.place_loss_backend(torch.device(device))
        assert (task.head.loss_options.backend, task.head.loss_options.plan) == ("torch", plan)


def test_fused_as_loss_backend_is_the_rows_plan_with_the_fused_products():
    """``model.loss_backend: fused``: the rows plan, its tiles as fused Triton products where
    they run Triton (CUDA); on a CPU the same rows plan."""
    task = LanguageModel(LSTMBackbone(30, 8, 8), SoftmaxHead(8, 30), loss_backend="fused")
    for device in ("cuda", "cpu"):
        task.place_loss_backend(torch.device(device))
        options = task.head.loss_options
        assert (options.backend, options.plan, options.fused_products) == ("torch", "rows", True)


def test_fused_says_in_one_line_where_its_products_cannot_run(monkeypatch, caplog):
    """``loss_backend: fused`` off CUDA, without Triton or with float32 products: one warning
    naming why, once the device and precision are known; none where they run."""
    import heads.kernels.rows_ce as rows_ce

    task = LanguageModel(LSTMBackbone(30, 8, 8), SoftmaxHead(8, 30), loss_backend="fused")
    cases = [("cpu", "bf16-mixed", False, "this run's device is cpu"),
             ("cuda", "bf16-mixed", False, "Triton is not importable"),
             ("cuda", "32-true", True, "bf16 or fp16 products, and this run's are torch.float32"),
             ("cuda", "16-mixed", True, None), ("cuda", "bf16-mixed", True, None)]  # fmt: skip
    for device, precision, triton, why in cases:
        monkeypatch.setattr(rows_ce, "triton_available", lambda triton=triton: triton)
        caplog.clear()
        with caplog.at_level("WARNING", logger="lightning_modules.head_task"):
            task.place_loss_backend(torch.device(device), precision)
        lines = [r.getMessage() for r in caplog.records]
        if why is None:
            assert lines == []
        else:
            assert len(lines) == 1 and why in lines[0] and "the rows plan runs" in lines[0]


def test_a_missing_or_misplaced_loss_backend_is_named_when_the_model_is_built():
    """CCE/Liger not installed: one line at construction, not at the first step; and a model
    placed on a CPU refuses them when the trainer sets it up (they run on CUDA only)."""
    from heads.fused_cross_entropy import MissingBackendError

    for backend in ("cce", "liger"):
        try:
            __import__({"cce": "cut_cross_entropy", "liger": "liger_kernel"}[backend])
        except ImportError:
            with pytest.raises(MissingBackendError, match="pip install") as raised:
                LanguageModel(LSTMBackbone(30, 8, 8), SoftmaxHead(8, 30), loss_backend=backend)
            assert "\n" not in str(raised.value)
    task = LanguageModel(LSTMBackbone(30, 8, 8), SoftmaxHead(8, 30), loss_backend="auto")
    task.place_loss_backend(torch.device("cpu"))
    assert task.head.loss_options.backend == "torch"
    task.loss_backend = "liger"  # as if installed: the device check still refuses a CPU
    with pytest.raises(MissingBackendError, match="CUDA only"):
        task.place_loss_backend(torch.device("cpu"))


def test_auto_on_cuda_takes_the_measured_backend_or_plan(monkeypatch):
    """The measured table may name a plan of the torch backend (rows) as well as a backend;
    the task sets it once the device is known (checked with a table stated here)."""
    import heads.fused_cross_entropy as fce

    monkeypatch.setattr(fce, "MEASURED_FASTEST", {"SoftmaxHead": [(50, "rows")]})
    task = LanguageModel(LSTMBackbone(30, 8, 8), SoftmaxHead(8, 30), loss_backend="auto")
    task.place_loss_backend(torch.device("cuda"))  # a property of the device: no CUDA needed
    assert (task.head.loss_options.backend, task.head.loss_options.plan) == ("torch", "rows")
    task = LanguageModel(LSTMBackbone(30, 8, 8), SoftmaxHead(8, 90), loss_backend="auto")
    task.place_loss_backend(torch.device("cuda"))  # V = 90: beyond the measured sizes
    assert (task.head.loss_options.backend, task.head.loss_options.plan) == ("torch", "auto")
    task.place_loss_backend(torch.device("cpu"))  # a CPU: always ours, its own auto plan
    assert (task.head.loss_options.backend, task.head.loss_options.plan) == ("torch", "auto")


def test_compile_option_takes_true_false_or_compile_arguments():
    from lightning_modules.errors import ModelConfigError

    assert model().compile_options is None
    task = LanguageModel(LSTMBackbone(30, 8, 8), SoftmaxHead(8, 30), compile=True)
    assert task.compile_options == {}
    task = LanguageModel(LSTMBackbone(30, 8, 8), SoftmaxHead(8, 30),
                         compile={"mode": "max-autotune", "dynamic": False})  # fmt: skip
    assert task.compile_options == {"mode": "max-autotune", "dynamic": False}
    with pytest.raises(ModelConfigError, match="model.compile must be true, false"):
        LanguageModel(LSTMBackbone(30, 8, 8), SoftmaxHead(8, 30), compile="yes")


def test_configure_model_compiles_the_head_in_place_once():
    """``nn.Module.compile``: the head's forward is compiled, its parameter names (and so
    checkpoints) are unchanged; the LSTM backbone, which Dynamo does not trace, stays eager."""
    task = LanguageModel(LSTMBackbone(30, 8, 8), SoftmaxHead(8, 30), compile=True)
    names = list(task.state_dict())
    task.configure_model()
    task.configure_model()
    assert task.head._compiled_call_impl is not None
    assert getattr(task.backbone, "_compiled_call_impl", None) is None
    assert list(task.state_dict()) == names
    # variable BPTT windows: a few dozen padded row counts, each compiled (not eager past 8)
    assert torch._dynamo.config.recompile_limit >= 32


def test_cuda_graphs_refuse_heads_sized_by_the_batch_and_other_libraries_kernels():
    from heads import DSSoftmaxHead
    from heads.errors import HeadConfigError
    from lightning_modules.errors import ModelConfigError

    with pytest.raises(HeadConfigError, match="DSSoftmaxHead.*cuda_graphs false"):
        LanguageModel(LSTMBackbone(30, 8, 8), DSSoftmaxHead(8, 30, num_experts=2),
                      cuda_graphs=True)  # fmt: skip
    with pytest.raises(ModelConfigError, match="loss_backend cce .*cuda_graphs false"):
        LanguageModel(LSTMBackbone(30, 8, 8), SoftmaxHead(8, 30), loss_backend="cce",
                      cuda_graphs=True)  # fmt: skip


def test_cuda_graphs_run_the_tasks_head_loss_and_auto_keeps_to_the_torch_backend(monkeypatch):
    """The task's steps call the head through its graphs (on the CPU: a stand-in capture);
    ``auto`` never resolves to another library's kernels when they are on."""
    from heads.graphs import GRAPH_DEVICES
    from tests.heads.test_graphs import Rerun

    task = LanguageModel(LSTMBackbone(30, 8, 8), SoftmaxHead(8, 30), cuda_graphs=True)
    assert not any("_graphed" in name for name, _ in task.named_modules())  # no second copy
    monkeypatch.setattr("heads.graphs.GRAPH_DEVICES", GRAPH_DEVICES | {"cpu"})
    capturer = task._graphed_loss.capture = Rerun()
    hidden = torch.randn(6, 8, requires_grad=True)
    target = torch.randint(0, 30, (6,))
    out = task.head_loss(hidden, target)
    torch.testing.assert_close(out.loss, task.head(hidden, target).loss)
    assert capturer.captures == [(6, 8)]
    monkeypatch.setattr("lightning_modules.head_task.fastest_backend", lambda *args: "cce")
    task.place_loss_backend(torch.device("cuda"))
    assert task.head.loss_options.backend == "torch"
