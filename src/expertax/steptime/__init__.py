"""Step time predicted from a compiled XLA program: its compute, every collective on the real
topology, what overlaps and what is exposed. A prediction from the program, never a measured
time; every report says so.

- `groups`: the devices a collective names (replica groups in XLA's four printed forms);
- `links`: the chips' peaks, links and achieved shares, one table with sources;
- `topology`: where logical devices sit (torus coordinates, GPU nodes) and what a group spans;
- `collectives`: bytes per device and seconds of each collective by a stated model;
- `compute`: an operation's time from its FLOPs and bytes;
- `simulate`: the schedule walked with a compute and a link stream;
- `report`: `estimate(hlo_text, placement, ...)` -> the report's JSON and its table;
- `plot`: the predicted timeline of one layer.
"""
