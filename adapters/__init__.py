"""Bridges from framework objects (torch's DDP, ZeroRedundancyOptimizer, any
torch Joinable) to joinery's Join."""
