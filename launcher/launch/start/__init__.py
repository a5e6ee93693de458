"""Starting the ranks on this machine: the command lines and scripts (argv.py, pure), the
nodes meeting before torchrun starts (rendezvous.py), the child supervised (supervise.py)
and its output sorted on the way to the terminal (console.py)."""
