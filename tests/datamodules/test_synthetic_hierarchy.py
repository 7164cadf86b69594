import pytest
import torch

from datamodules import SyntheticHierarchyDataModule
from datamodules.errors import DataConfigError
from datamodules.synthetic_hierarchy import make_hierarchy


def test_shapes_labels_and_vocab_size():
    dm = SyntheticHierarchyDataModule(num_super=3, num_sub=4, dim=5, train_per_sub=7)
    assert dm.vocab_size == 12 and dm.input_size == 5
    x, y = dm.data["train"]
    assert x.shape == (84, 5) and y.shape == (84,)
    assert torch.equal(torch.bincount(y), torch.full((12,), 7))
    assert torch.equal(dm.super_class(torch.tensor([0, 3, 4, 11])), torch.tensor([0, 0, 1, 2]))
    batch = next(iter(dm.train_dataloader()))
    assert batch[0].shape[1] == 5


def test_deterministic_and_normalised():
    a = SyntheticHierarchyDataModule(seed=3).data["valid"]
    b = SyntheticHierarchyDataModule(seed=3).data["valid"]
    assert torch.equal(a[0], b[0])
    assert not torch.equal(a[0], SyntheticHierarchyDataModule(seed=4).data["valid"][0])
    assert 0.3 < a[0].std() < 3  # unit scale after normalisation


def test_eq_3_to_5_variances():
    """Sub centroids spread with variance d^2 around their super centroid, points with d."""
    dim, num_sub = 10, 50
    data = make_hierarchy(2, num_sub, dim, {"train": 200}, seed=0)
    x, y = data["train"]
    sub_means = torch.stack([x[y == j].mean(0) for j in range(2 * num_sub)])
    point_var = torch.stack([x[y == j].var(0).mean() for j in range(2 * num_sub)]).mean()
    sub_var = sub_means[:num_sub].var(0).mean()
    assert point_var == pytest.approx(dim, rel=0.1)
    assert sub_var == pytest.approx(dim**2, rel=0.3)
    # super classes are far apart compared with their sub classes
    gap = (sub_means[:num_sub].mean(0) - sub_means[num_sub:].mean(0)).norm()
    assert gap > 2 * sub_var.sqrt()


@pytest.mark.parametrize("option", ["num_super", "num_sub", "dim", "batch_size"])
def test_bad_config(option):
    with pytest.raises(DataConfigError, match=option):
        SyntheticHierarchyDataModule(**{option: 0})
