"""An SGLang-compatible emulated worker: the GPU engine is replaced by a cost model, everything
around it (HTTP API, prefix cache, KV events, Mooncake global tier, PD hand-off) is real.

Modules: ``cache`` (block prefix cache, LRU, KV events), ``tokenizer`` (deterministic tokenizer
and chat template), ``engine`` (the parts of one worker: prefill scheduler, prefix cache, global tier, PD hand-off), ``server`` (FastAPI
app speaking SGLang's worker API), ``cli`` (``smetric worker --emulate``); ``fake`` (a CPU-cheap SGLang-protocol responder
for the router overhead bench and router tests, not the emulator).
"""
