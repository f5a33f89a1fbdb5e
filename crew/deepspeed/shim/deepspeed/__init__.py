# `crew run --as_deepspeed` puts the folder above this one first on every rank's PYTHONPATH, so that a
# script's `import deepspeed` lands here and is handed crew (see crew/deepspeed/alias.py).
from crew.deepspeed.alias import install

install()
