"""DS-Softmax training (the paper's Algorithm 1): group-lasso pruning, mitosis, the experts'
target classes, their monitor, and the optimizer surgery they share (``optim.py``)."""
