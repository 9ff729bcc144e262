"""The one compiled part: the broker's fast path (broker/_fastroute.c). It is optional:
where it cannot be built (no C compiler or Python headers), fedbus installs without it and
the broker runs the same checks in Python (fedbus.broker.fastroute)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("fedbus.broker._fastroute", ["broker/_fastroute.c"],
                             optional=True, extra_compile_args=["-O2"])])
