"""Hardware profiles shipped with the package (``<name>.yaml``), read by ``cost/hardware.py`` with importlib.resources."""
