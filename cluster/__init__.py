"""pagefleet.cluster — `pagefleet` CLI, serve options, the Serve app builder, Ray bring-up."""
