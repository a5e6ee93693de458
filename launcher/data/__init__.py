"""Data: `prepare` tokenizes text on the launch side once (data=hf_text), `read` is the
rank side's datasets, the global-sample-index sampler and the loader."""
