"""`recursive_getattr`/`recursive_setattr` (deepspeed.utils.module_utils, re-exported by
deepspeed.compression.helper as in DeepSpeed 0.19.8), and `import deepspeed.compression...` under the alias."""

from __future__ import annotations

import pytest
import torch
from shimrun import run_as_deepspeed

from crew.deepspeed.utils.module_utils import recursive_getattr, recursive_setattr


def nested() -> torch.nn.Module:
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())])
    return model


def test_getattr_follows_dotted_names_through_lists_and_sequentials():
    model = nested()
    assert recursive_getattr(model, "decoder.layers.0.0") is model.decoder.layers[0][0]
    assert recursive_getattr(model, "decoder.layers.0.0.weight") is model.decoder.layers[0][0].weight
    assert recursive_getattr(model, "decoder") is model.decoder
    with pytest.raises(AttributeError, match="nope"):
        recursive_getattr(model, "decoder.nope.weight")


def test_setattr_registers_the_new_module_where_the_old_one_was():
    model = nested()
    old = model.decoder.layers[0][0]
    replacement = torch.nn.Linear(4, 2)
    recursive_setattr(model, "decoder.layers.0.0", replacement)
    assert model.decoder.layers[0][0] is replacement
    names = dict(model.named_modules())
    assert names["decoder.layers.0.0"] is replacement and old not in names.values()
    assert [n for n, _ in model.named_parameters()] == ["decoder.layers.0.0.weight", "decoder.layers.0.0.bias"]
    top = torch.nn.Linear(2, 2)
    recursive_setattr(model, "head", top)  # one name: set on the model itself
    assert model.head is top and "head.weight" in dict(model.named_parameters())
    weight = torch.nn.Parameter(torch.zeros(2, 4))
    recursive_setattr(model, "decoder.layers.0.0.weight", weight)  # a parameter registers as one
    assert model.decoder.layers[0][0].weight is weight
    with pytest.raises(AttributeError, match="missing"):
        recursive_setattr(model, "decoder.missing.x", top)


SCRIPT = """
    import sys, warnings
    sys.path.insert(0, sys.argv[1])
    import deepspeed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from deepspeed.compression.helper import recursive_getattr, recursive_setattr
    from deepspeed.utils.module_utils import recursive_getattr as from_module_utils
    import crew.deepspeed.utils.module_utils as crews
    print(recursive_getattr is crews.recursive_getattr is from_module_utils is deepspeed.utils.recursive_getattr,
          recursive_setattr is crews.recursive_setattr is deepspeed.utils.recursive_setattr)
    print([(w.category.__name__, str(w.message).split(";")[0], w.filename) for w in caught])
    for attempt in ("__import__('deepspeed.compression.compress')", "deepspeed.compression.init_compression"):
        try:
            eval(attempt)
        except deepspeed.CrewError as error:
            print(type(error).__name__, error)
"""


def test_deepspeed_chats_import_resolves_to_crew_and_the_rest_of_compression_is_refused(tmp_path):
    lines = run_as_deepspeed(SCRIPT, tmp_path)
    assert lines[0] == "True True"
    # as DeepSpeed 0.19.8: a FutureWarning that points at the script's import line (not at crew's alias loader)
    assert lines[1] == "[('FutureWarning', 'deepspeed.compression.helper is deprecated', '<string>')]"
    assert lines[2].startswith("UnsupportedModule deepspeed.compression.compress (model compression) is not "
                               "supported by crew")
    assert lines[3].startswith("UnsupportedAttribute deepspeed.compression.init_compression (model compression) "
                               "is not supported by crew")
