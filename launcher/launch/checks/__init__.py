"""Checks of a composed config on the launch side, before anything is written or started:
each raises launcher.config.ConfigError (one line, exit 2). validate.py runs the cross-field
checks; the others are the checks of one concern each (levers, data, plain text, a
checkpoint's fit, what the user asked for)."""
