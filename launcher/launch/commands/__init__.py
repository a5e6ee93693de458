"""The commands besides `launcher train` (whose steps are cli.py's): `launcher plan` and
`rehearse` (plan.py, also recipe=auto and train.micro_batch=auto), `launcher data`
(data.py), `launcher export` (export.py), and a sweep's points and table (sweep.py)."""
