"""kvoffloadctl: the admin CLI of kvoffloadd (stats, clients, evict, top, config)."""
