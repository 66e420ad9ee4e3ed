-- The open loss run of a command (plan §7.2, R-7.2-12): its known totals,
-- as the encoded CLIENT_OVERLOAD OutputTruncation it will become, recorded
-- when the run opens and as it grows, and cleared by the command's next
-- spool entry (the marker itself, or anything after it). A restart closes a
-- recorded run into its marker before the command's next event, so a crash
-- in loss mode never leaves a silent gap.
ALTER TABLE commands ADD COLUMN loss_run BLOB;
