"""kvoffloadctl: admin CLI and benchmark harness for kvoffloadd."""
