"""DS-Softmax (Liao et al. 2019) as one package, imported one way: ``structure`` (what
inference reads of a head, and the helpers both share), ``svd`` (the SVD-softmax preview) and
``native`` (the optional C kernel) import nothing else of it; ``inference`` (the top-k paths,
on a ``DSStructure``) imports those; ``softmax`` (the head, ``DSSoftmaxHead``) imports all."""

from heads.ds.softmax import DSSoftmaxHead

__all__ = ["DSSoftmaxHead"]
