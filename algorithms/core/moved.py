"""Old module names that still import, each with a DeprecationWarning naming the new one.

The layout of issue 24 moved modules (fedbus.algorithms.base -> fedbus.algorithms.core,
fedbus.node.replay -> fedbus.analysis.replay, ...). A package lists its moved names with
`alias_moved(package, {old: new modules})`; `import fedbus.node.replay` then gives the
module fedbus.analysis.replay itself (one target), or a module holding the public names
of several (fedbus.algorithms.base: the handlers and the metrics it held). It lives here,
below node, so that both fedbus.algorithms and fedbus.node can register their names.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Mapping, Sequence


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, moved: Mapping[str, Sequence[str]]):
        self.moved = dict(moved)

    def find_spec(self, name, path=None, target=None):
        if name not in self.moved:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        return None  # a fresh module; exec_module fills it or swaps it out

    def exec_module(self, module) -> None:
        targets = self.moved[module.__name__]
        warnings.warn(f"{module.__name__} moved to {' and '.join(targets)}; import it "
                      f"from there", DeprecationWarning, stacklevel=2)
        mods = [importlib.import_module(t) for t in targets]
        if len(mods) == 1:
            # the import machinery returns what sys.modules holds after exec_module: the
            # moved module itself, so its state is shared and its __spec__ untouched
            sys.modules[module.__name__] = mods[0]
            return
        for mod in mods:
            module.__dict__.update({k: v for k, v in vars(mod).items()
                                    if not k.startswith("__")})


def alias_moved(package: str, moved: Mapping[str, Sequence[str]]) -> None:
    """Make `package.<old>` import as the modules `moved[old]` (full names)."""
    finder = _MovedModules({f"{package}.{old}": list(new) for old, new in moved.items()})
    sys.meta_path.append(finder)
