"""On the device: requirements.txt = requirements.all less what the system torch's site-packages
already has (transformers, accelerate, numpy ...) and less what this folder lacks (said)."""
import pathlib, re, sys
from importlib import metadata
import torch
here = pathlib.Path(__file__).parent
site = str(pathlib.Path(torch.__file__).parent.parent)
have = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d.version for d in metadata.distributions(path=[site])}
files = {re.sub(r"[-_.]+", "-", f.name.split("-")[0]).lower() for f in here.glob("*.whl")}
keep = []
for line in (here / "requirements.all").read_text().split():
    name = line.split("==")[0]
    if name in have:
        print(f"system has {name} {have[name]} (wheelhouse {line})")
    elif name not in files:
        print(f"MISSING everywhere: {line}")
    else:
        keep.append(line)
(here / "requirements.txt").write_text("\n".join(keep) + "\n")
print(f"installing {len(keep)}: {' '.join(keep)}")
