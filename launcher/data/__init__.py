"""Data: `prepare` tokenizes text (data=hf_text) or conversations (data=chat) on the launch
side once, `read` is the rank side's datasets, the global-sample-index sampler, the loader
and `micro_batch`."""
