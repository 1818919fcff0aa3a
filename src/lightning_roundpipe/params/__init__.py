"""Host state of the parameters: masters, compute-dtype shadows, gradient buffers, versions."""
