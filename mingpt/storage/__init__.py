"""Where things are kept: what a location is (locations) and writes that survive a crash (durable)."""
