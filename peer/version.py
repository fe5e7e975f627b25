"""The installed version of swarmtrain (the source tree's, when not installed)."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("swarmtrain")
except PackageNotFoundError:
    __version__ = "0.0.0+source"
