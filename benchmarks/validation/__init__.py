"""Do the models predict the engine, and is the engine exact? Predicted against measured, pipelined against not."""
