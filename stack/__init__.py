"""stack: an SMetric-routed, PD-disaggregated SGLang serving stack and its simulator."""

__version__ = "0.1.0"
