"""The autodiff layer: custom_vjp, jacobians, remat."""
