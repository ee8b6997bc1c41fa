-- A fork child's volume (issue 26): a copy-on-write clone of the frozen
-- point that fork snapshot source_snapshot took of volume source_volume
-- (the snapshot's id is the fork's). With it, whoever finishes the
-- volume's create (the fork pass, or the host monitor for a replica that
-- died) asks the agent for the same thing.
ALTER TABLE volumes ADD COLUMN source_snapshot TEXT NOT NULL DEFAULT '';
