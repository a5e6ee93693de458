"""The memory model (`memory`: terms per rank; `footprint`: a layout's states, activations and
start-up) and `make plan` (`plan`: candidate layouts, the table, the recommendation).
Read by the launch side (make plan, auto choices) and by the rank side's measurements."""
