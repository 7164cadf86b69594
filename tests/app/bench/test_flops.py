import torch

from app.bench.flops import matmul_flops
from app.bench.subjects import BenchOptions, build_head, step_fn


def test_counts_the_in_place_and_vector_products_the_registry_lacks():
    a, b, out = torch.randn(6, 5), torch.randn(5, 7), torch.zeros(6, 7)
    vector, batch = torch.randn(5), torch.randn(3, 6, 5)

    def products():
        torch.mm(a, b, out=out)  # 2*6*5*7 = 420
        out.addmm_(a, b)  # 420
        torch.mv(a, vector)  # 2*6*5 = 60
        torch.addmv(torch.zeros(6), a, vector)  # 60
        torch.bmm(batch, b.expand(3, 5, 7))  # 3*420 = 1260
        torch.zeros(3, 6, 7).baddbmm_(batch, b.expand(3, 5, 7))  # 1260
        torch.tanh(out)  # elementwise: not counted

    assert matmul_flops(products) == 420 + 420 + 60 + 60 + 1260 + 1260


def _step(name, hidden, vocab, tokens, **options):
    torch.manual_seed(0)
    head = build_head(name, hidden, vocab, BenchOptions(**options))
    x = torch.randn(tokens, hidden, requires_grad=True)
    return step_fn(head, x, torch.randint(0, vocab, (tokens,)))


def test_softmax_step_counts_its_three_products():
    n, d, v = 64, 16, 300
    # the column plan, its chunk kept (a CPU's default at this size): forward h W^T, backward
    # dL W and dL^T h; the bias gradient is a [V, N] x [N] product
    assert matmul_flops(_step("softmax", d, v, n)) == 3 * 2 * n * v * d + 2 * n * v
    # the rows plan: the same three products, all in the forward; the bias gradient a sum
    assert matmul_flops(_step("softmax@rows", d, v, n)) == 3 * 2 * n * v * d


def test_a_recomputed_chunk_costs_one_more_forward_product():
    from heads.fused_cross_entropy import LossOptions

    n, d, v = 64, 16, 300
    step = _step("softmax@eager", d, v, n)
    step.module.loss_options = LossOptions(plan="eager", saved_bytes=0)
    assert matmul_flops(step) == 4 * 2 * n * v * d + 2 * n * v


def test_mixtape_step_counts_every_product_of_its_hand_written_backward():
    n, d, v, k, ratio, d2 = 64, 16, 300, 4, 0.1, 64
    s = 30  # ceil(r V) frequent tokens
    forward = (
        n * d * k * d  # contexts, Eq. 5
        + n * d * (k - 1) * d2  # tanh(U_k g), Eq. 4
        + n * d * (k - 1)  # u_k . g, Eq. 4 and 6
        # [tanh(U g) | u.g | e_k | 0] [v_x | 1 | b_x | 0]^T, d2 + K padded to 72 columns
        + n * (k - 1) * -(-(d2 + k) // 8) * 8 * s
        + n * k * d * s  # h_k . w_x, frequent tokens
        + n * k * d  # contexts mixed by the shared prior
        + n * d * (v - s)  # mixed . w_x, the rest
    )
    bias_gradient = n * (v - s)  # a product for the rare tokens (the frequent ones: a sum)
    # every product is run three times (forward, and the gradient of each operand; the small
    # blocks are kept, not recomputed)
    expected = 2 * (3 * forward + bias_gradient)
    options = {"mixtape": {"num_components": k, "frequent_ratio": ratio}}
    assert matmul_flops(_step("mixtape", d, v, n, init_args=options)) == expected


def test_the_products_it_counts_are_torchs():
    from app.bench.flops import counted_products

    for name in ("softmax", "mixtape@rows", "mos@compiled+graphs", "adaptive@plain", "matmul"):
        assert counted_products(name), name
    for name in ("softmax@cce", "softmax@liger", "mos@liger", "mixtape@fused", "cce", "liger",
                 "adaptive@fused+graphs"):  # fmt: skip
        assert not counted_products(name), name
