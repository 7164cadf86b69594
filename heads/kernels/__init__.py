"""Execution plans under the heads' maths: how a loss runs on a device, not what it computes."""
