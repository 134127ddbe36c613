"""``import tensorrt`` from the TensorRT bindings wheel alone.

Installed as ``tensorrt/__init__.py`` in the image's virtualenv: the same two lines as the
``tensorrt-cu12`` sdist's package, without that sdist's download of the TensorRT libraries, so that the
bindings load the image's own libnvinfer (the library Triton runs the engines with).
"""

from tensorrt_bindings import *  # noqa: F403
from tensorrt_bindings import __version__  # noqa: F401
