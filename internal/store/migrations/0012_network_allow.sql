-- What a nat network's guests may reach besides their own network and the
-- outside through NAT (JSON list of nat network names and IPv4 CIDRs; []:
-- nothing more). The agents fence off the rest: the host, the other
-- networks, the private ranges.
ALTER TABLE networks ADD COLUMN allow TEXT NOT NULL DEFAULT '[]';
