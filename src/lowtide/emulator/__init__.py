"""Stand-ins for the inference fleet on machines without GPUs (demo, tests, benchmarks).

`engine` is a capacity model of one vLLM replica (continuous batching, KV cache, prefill and decode
timing, cold start, sleep mode) driven by an injected clock; `vllm_metrics_export` renders it as
vLLM's `/metrics`; `openai_shapes` and `server` put vLLM's OpenAI-compatible HTTP API in front of it
(`lowtide emulate vllm`). `traces` and `loadgen` replay real workload traces against any
OpenAI-compatible server (`lowtide loadgen`). Real deployments point lowtide at real vLLM.
Neighbours: `cli.emulate_cmd`, `cli.loadgen_cmd`. Must not: import lowtide beyond `lowtide.domain`
(store, control, api and wiring are above this layer).
"""
