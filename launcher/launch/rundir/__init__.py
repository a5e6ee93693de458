"""The run directory: what is checked and written into it before the ranks start
(prepare.py) and which run its checkpoint folder belongs to (identity.py)."""
