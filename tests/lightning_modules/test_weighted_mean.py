import pytest
import torch

from lightning_modules.weighted_mean import WeightedMean


def test_batch_means_count_by_their_weights():
    # a 5-token window's mean NLL and a 350-token one's: the tokens' mean, not the windows'
    mean = WeightedMean()
    mean.update(torch.tensor(2.0), weight=torch.tensor(350))
    mean.update(torch.tensor(9.0), weight=torch.tensor(5))
    assert mean.compute().item() == pytest.approx((2.0 * 350 + 9.0 * 5) / 355)


def test_numbers_and_masks_weigh_each_element():
    mean = WeightedMean()
    mean.update(torch.tensor([1.0, 2.0]), weight=2)  # each element weighs 2
    mean.update(torch.tensor(4.0))
    assert mean.compute().item() == pytest.approx((2 * 3.0 + 4.0) / 5)
    hits = WeightedMean()
    kept = torch.tensor([1.0, 0.0, 1.0, 1.0])  # the ignored token's miss does not count
    hits.update(torch.tensor([1.0, 0.0, 0.0, 1.0]), weight=kept)
    assert hits.compute().item() == pytest.approx(2 / 3)
    hits.reset()
    hits.update(torch.tensor([[1.0, 0.0]]), weight=torch.tensor([[3.0], [1.0]]))  # broadcast
    assert hits.compute().item() == pytest.approx(4 / 8)


def test_an_update_reads_nothing_back(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a host read-back in an update")

    mean = WeightedMean()
    value, weight = torch.tensor([0.5, 1.5]), torch.tensor([2, 0])
    for name in ("item", "tolist", "__bool__", "cpu", "numpy", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    mean.update(value, weight=weight)
    mean.update(value, weight=3)
    monkeypatch.undo()
    assert mean.compute().item() == pytest.approx((1.0 + 3 * 2.0) / (2 + 6))
