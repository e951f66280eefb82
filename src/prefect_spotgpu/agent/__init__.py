"""The node agent: GPU discovery, heartbeats, and running the market's work on one host."""
