"""The plain vocabulary every driver shares: requests, instance states, cluster views,
decisions (:mod:`stack.core.types`) and the prefill and decode cost models with their SLOs
(:mod:`stack.core.cost_model`). No I/O; the dispatcher, the policies, the live router and the
simulator all stand on it."""
