"""Issue 31's claim where the optimum is known exactly: on the synthetic rank-r Markov chain
(``datamodules/markov_chain.py``), a softmax over d < r inputs stays clearly above the optimum,
while MoS and Mixtape at the same d each close at least half of the gap between softmax's
excess and the floor that finite data and the budget leave (softmax at d > r).

Short on purpose (one seed, V = 128, r = 16, d = 4 and 24, 2,500 Adam updates of 1,024 token
pairs, about 2 minutes on one core): a plain loop over the heads and the n-gram backbone, the
NLL evaluated exactly on the whole test split. The CPU study
(``configs/studies/markov_bottleneck_cpu.yaml``) measures the same with seeds and error bars."""

import pytest
import torch

from datamodules import MarkovChainDataModule
from heads import MixtapeHead, MoSHead, SoftmaxHead
from lightning_modules.backbones import NGramBackbone

V, R, SMALL, LARGE = 128, 16, 4, 24
STEPS, BATCH, LR = 2500, 1024, 0.02

HEADS = {
    "softmax": lambda d: SoftmaxHead(d, V),
    "mos": lambda d: MoSHead(d, V, num_components=8),
    # every token with its own gates (frequent_ratio 1), as in the CPU study
    "mixtape": lambda d: MixtapeHead(d, V, num_components=4, frequent_ratio=1.0),
}


def _excess(data: MarkovChainDataModule, head_name: str, d: int, seed: int = 1) -> float:
    """Test NLL minus the true chain's NLL on the same tokens (nats)."""
    train = data.split_tokens("train").long()
    test = data.split_tokens("test").long()
    torch.manual_seed(seed)
    backbone, head = NGramBackbone(V, d), HEADS[head_name](d)
    optimizer = torch.optim.Adam([*backbone.parameters(), *head.parameters()], lr=LR)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        index = torch.randint(0, len(train) - 1, (BATCH,), generator=generator)
        hidden, _ = backbone(train[index][None])
        loss = head(hidden[0], train[index + 1]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    head.eval()
    with torch.no_grad():
        hidden, _ = backbone(torch.arange(V)[None])
        log_prob = head.log_prob(hidden[0])  # [context, next token]
    return -log_prob[test[:-1], test[1:]].mean().item() - data.optimum_nll("test")


@pytest.mark.slow
def test_mos_and_mixtape_break_the_bottleneck(tmp_path):
    torch.set_num_threads(1)
    data = MarkovChainDataModule(
        vocab_size=V, rank=R, train_tokens=300_000, valid_tokens=1000, test_tokens=100_000,
        cache_dir=str(tmp_path),
    )  # fmt: skip
    assert data.summary["centred_rank"] == R
    floor = _excess(data, "softmax", LARGE)
    softmax = _excess(data, "softmax", SMALL)
    assert floor < 0.06, f"the floor at d = {LARGE} > r = {R} is not small: {floor:.3f} nats"
    assert softmax > floor + 0.1, f"softmax at d = {SMALL}: {softmax:.3f}, floor {floor:.3f}"
    for name in ("mos", "mixtape"):
        excess = _excess(data, name, SMALL)
        closed = (softmax - excess) / (softmax - floor)
        assert closed >= 0.5, (
            f"{name} at d = {SMALL} closes {closed:.0%} of softmax's excess above the floor "
            f"({excess:.3f} against softmax {softmax:.3f}, floor {floor:.3f} nats)"
        )
