"""Rates of a machine measured or fitted here; their outputs feed the hardware profiles, each naming its producer."""
