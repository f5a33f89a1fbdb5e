"""What crew prints: ranks' lines merged, progress bars drawn or thinned, rank ranges said briefly."""
