import lightning as L
import pytest
import torch

from app.callbacks import DSMonitor
from datamodules import SyntheticHierarchyDataModule
from heads import DSSoftmaxHead
from tests.app.callbacks.ds.test_mitosis import make_model, trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_monitor_logs_speedup_and_heatmap(tmp_path):
    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=2, num_sub=2, train_per_sub=8, batch_size=32)
    model = make_model(dm, num_experts=4)
    logger = L.pytorch.loggers.TensorBoardLogger(tmp_path)
    monitor = DSMonitor(heatmap_columns=3)
    t = trainer(1, [monitor], logger=logger)
    t.fit(model, dm)
    metrics = t.callback_metrics
    # no pruning: every expert holds all 4 classes, so the speed-up is V / (V + K) = 0.5
    assert float(metrics["ds/speedup"]) == pytest.approx(4 / (4 + 4))
    assert float(metrics["ds/num_experts"]) == 4
    assert {"ds/speedup", "ds/num_experts"} <= set(t.progress_bar_metrics)  # a DS run's console
    assert monitor.heatmap(model.head).shape == (4, 3)
    assert list(tmp_path.rglob("events.out.tfevents*"))


def test_heatmap_bins_classes():
    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=2, num_sub=3)
    head = make_model(dm, num_experts=2).head
    head.prune(gamma=1e9, keep_every_class=True)  # each class keeps exactly one row
    image = DSMonitor(heatmap_columns=2).heatmap(head)
    assert image.shape == (head.num_experts, 2)
    # each bin's classes live in exactly one expert: shares over experts add up to 1
    torch.testing.assert_close(image.sum(0), torch.ones(2))


def test_topk_accuracy_callback_matches_the_classifier_metrics():
    from app.callbacks import TopKAccuracy

    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=2, num_sub=4, train_per_sub=16, batch_size=32)
    model = make_model(dm, num_experts=2)
    t = trainer(2, [TopKAccuracy(top_k=(1, 5, 50), prefix="cb_")])
    t.fit(model, dm)
    metrics = t.callback_metrics
    for k in (1, 5):
        torch.testing.assert_close(metrics[f"val/cb_acc_top{k}"], metrics[f"val/acc_top{k}"])
    assert "val/cb_acc_top50" not in metrics  # k above the class count is skipped
    (result,) = t.test(model, dm, verbose=False)
    assert result["test/cb_acc_top1"] == pytest.approx(result["test/acc_top1"])


def test_the_callbacks_leave_a_compiled_head_one_graph_per_shape():
    """They read what the head saw after each batch (the task's ``head_inputs``), not by a
    forward hook, which ran inside the compiled head: a new hook each validation was a new
    compilation, and its boolean-mask reads broke the graph. Dynamo alone (its graphs
    counted by a backend that runs them as traced)."""
    from app.callbacks import TopKAccuracy
    from lightning_modules import Classifier
    from lightning_modules.backbones import MLPBackbone

    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=2, num_sub=4, train_per_sub=16, batch_size=32)
    graphs = []

    def counting_backend(graph, example_inputs):
        graphs.append([tuple(x.shape) for x in example_inputs if isinstance(x, torch.Tensor)][:1])
        return graph.forward

    model = Classifier(MLPBackbone(dm.input_size, 16), DSSoftmaxHead(16, dm.vocab_size, 2),
                       optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
                       compile={"backend": counting_backend})  # fmt: skip
    model.backbone.compile = lambda **options: None  # the head's graphs alone
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        t = trainer(3, [DSMonitor(), TopKAccuracy(top_k=(1, 5), prefix="cb_")])
        t.fit(model, dm)
    torch._dynamo.reset()
    assert not model.head._forward_hooks
    for k in (1, 5):  # the callback's hits, as the task's own
        torch.testing.assert_close(t.callback_metrics[f"val/cb_acc_top{k}"],
                                   t.callback_metrics[f"val/acc_top{k}"])  # fmt: skip
    # training and validation (grad mode), each batch shape once: 3 validations, no more
    shapes = {(tuple(b[0].shape), train) for train in (True, False)
              for b in (dm.train_dataloader() if train else dm.val_dataloader())}  # fmt: skip
    assert len(graphs) <= len(shapes), graphs
