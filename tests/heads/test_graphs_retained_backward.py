"""heads/graphs.py: a graphed step's backward runs once, right after its forward. The backward
graph consumes what the forward replay left (the rows plans hand their stored gradients over,
scaled in place: heads/kernels/rows_ce.py ``scaled_gradients``), so a second backward through
a retained graph, or a step's backward after a later step's forward, would give wrong
gradients silently: both are refused, in a line that names the fix."""

from __future__ import annotations

import pytest
import torch

from heads import SoftmaxHead
from heads.graphs import GraphedTrainingLoss
from tests.heads.test_graphs import D, Rerun, V, _batch, on_cpu  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("on_cpu")


def _graphed():
    head = SoftmaxHead(D, V).double().train()
    return GraphedTrainingLoss(head, capture=Rerun())


def test_a_second_backward_through_a_retained_step_is_refused():
    graphed = _graphed()
    graphed(*_batch(seed=0)).loss.backward()  # the capture's step
    out = graphed(*_batch(seed=1))  # a replay
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cuda_graphs: a graphed step's backward runs once"):
        out.loss.backward()


def test_a_steps_backward_after_a_later_forward_is_refused():
    graphed = _graphed()
    graphed(*_batch(seed=0)).loss.backward()
    first = graphed(*_batch(seed=1))
    first.loss.backward(retain_graph=True)
    second = graphed(*_batch(seed=2))  # the graph's buffers now hold this step
    with pytest.raises(RuntimeError, match="set cuda_graphs false"):
        first.loss.backward()
    second.loss.backward()  # its own backward runs
    graphed(*_batch(seed=3)).loss.backward()  # and steps go on


def test_one_backward_a_step_still_gives_the_heads_gradients():
    graphed = _graphed()
    twin = SoftmaxHead(D, V).double().train()
    twin.load_state_dict(graphed.head.state_dict())
    for seed in range(3):
        hidden, target = _batch(seed=seed)
        graphed(hidden, target).loss.backward()
        twin(hidden.detach(), target).loss.backward()
    for p, q in zip(graphed.head.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
