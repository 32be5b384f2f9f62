"""``pagefleet bench``: the serving benchmark client, datasets, metrics, report and plots."""
