"""Inner (test-time) losses with their closed-form gradients: defined in ``vit3.kernels.losses`` (below the
layers: the kernels' references read them too), re-exported here for the inner loop."""

from vit3.kernels.losses import loss_grad, loss_needs_prediction, loss_value

__all__ = ["loss_grad", "loss_needs_prediction", "loss_value"]
