"""Hardware profiles shipped with the package (``<name>.yaml``), read by ``sim.hardware`` with importlib.resources."""
