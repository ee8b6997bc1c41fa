--
-- PostgreSQL database dump
--


-- Dumped from database version 15.20 (Debian 15.20-0+deb12u1)
-- Dumped by pg_dump version 15.20 (Debian 15.20-0+deb12u1)

SET statement_timeout = 0;
SET lock_timeout = 0;
SET idle_in_transaction_session_timeout = 0;
SET client_encoding = 'UTF8';
SET standard_conforming_strings = on;
SELECT pg_catalog.set_config('search_path', '', false);
SET check_function_bodies = false;
SET xmloption = content;
SET client_min_messages = warning;
SET row_security = off;

SET default_tablespace = '';

SET default_table_access_method = heap;

--
-- Name: deleted_vms; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.deleted_vms (
    vm_id text NOT NULL,
    host_name text NOT NULL,
    deleted_at timestamp without time zone NOT NULL
);


--
-- Name: forks; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.forks (
    id text NOT NULL,
    source_vm_id text NOT NULL,
    source_host text NOT NULL,
    image text NOT NULL,
    vcpus bigint NOT NULL,
    memory_mib bigint NOT NULL,
    disk_mib bigint NOT NULL,
    child_count integer NOT NULL,
    pause_source boolean DEFAULT false NOT NULL,
    placement text NOT NULL,
    snapshot_taken boolean DEFAULT false NOT NULL,
    snapshot_hosts text DEFAULT '[]'::text NOT NULL,
    phase text NOT NULL,
    error text DEFAULT ''::text NOT NULL,
    idempotency_key text,
    created_at timestamp without time zone NOT NULL,
    updated_at timestamp without time zone NOT NULL,
    nics text DEFAULT '[]'::text NOT NULL,
    constraints text DEFAULT ''::text NOT NULL,
    owner_replica text,
    guest text,
    idempotency_caller text DEFAULT ''::text NOT NULL
);


--
-- Name: group_domains; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.group_domains (
    group_name text NOT NULL,
    spread_by text NOT NULL,
    domain text NOT NULL,
    vm_count integer NOT NULL,
    vm_cap integer DEFAULT 0 NOT NULL,
    CONSTRAINT group_domains_cap CHECK (((vm_cap = 0) OR (vm_count <= vm_cap))),
    CONSTRAINT group_domains_vm_count_check CHECK ((vm_count >= 0))
);


--
-- Name: hosts; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.hosts (
    name text NOT NULL,
    address text NOT NULL,
    labels text DEFAULT '{}'::text NOT NULL,
    schedulable boolean DEFAULT true NOT NULL,
    alive boolean DEFAULT false NOT NULL,
    missed_syncs integer DEFAULT 0 NOT NULL,
    last_seen timestamp without time zone,
    accel text DEFAULT ''::text NOT NULL,
    driver text DEFAULT ''::text NOT NULL,
    images text DEFAULT '[]'::text NOT NULL,
    cpu_allocation_ratio double precision DEFAULT 1 NOT NULL,
    memory_reserved_mib bigint DEFAULT 0 NOT NULL,
    total_vcpus bigint DEFAULT 0 NOT NULL,
    total_memory_mib bigint DEFAULT 0 NOT NULL,
    total_disk_mib bigint DEFAULT 0 NOT NULL,
    cap_vcpus bigint DEFAULT 0 NOT NULL,
    cap_memory_mib bigint DEFAULT 0 NOT NULL,
    cap_disk_mib bigint DEFAULT 0 NOT NULL,
    alloc_vcpus bigint DEFAULT 0 NOT NULL,
    alloc_memory_mib bigint DEFAULT 0 NOT NULL,
    alloc_disk_mib bigint DEFAULT 0 NOT NULL,
    warm_pool text DEFAULT '[]'::text NOT NULL,
    created_at timestamp without time zone NOT NULL,
    updated_at timestamp without time zone NOT NULL,
    agent_key text DEFAULT ''::text NOT NULL,
    warm_vcpus bigint DEFAULT 0 NOT NULL,
    warm_memory_mib bigint DEFAULT 0 NOT NULL,
    warm_disk_mib bigint DEFAULT 0 NOT NULL,
    isolation text DEFAULT ''::text NOT NULL,
    retired_at timestamp without time zone,
    CONSTRAINT hosts_check CHECK (((alloc_vcpus >= 0) AND (alloc_memory_mib >= 0) AND (alloc_disk_mib >= 0)))
);


--
-- Name: idempotency_keys; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.idempotency_keys (
    scope text NOT NULL,
    caller text NOT NULL,
    idem_key text NOT NULL,
    request_hash text NOT NULL,
    status integer DEFAULT 0 NOT NULL,
    response text DEFAULT ''::text NOT NULL,
    lease_until bigint NOT NULL,
    expires_at bigint NOT NULL,
    created_at timestamp without time zone NOT NULL
);


--
-- Name: images; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.images (
    name text NOT NULL,
    source_url text NOT NULL,
    sha256 text NOT NULL,
    format text NOT NULL,
    min_disk_mib bigint DEFAULT 0 NOT NULL,
    prefetch boolean DEFAULT false NOT NULL,
    created_at timestamp without time zone NOT NULL,
    updated_at timestamp without time zone NOT NULL
);


--
-- Name: networks; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.networks (
    name text NOT NULL,
    mode text NOT NULL,
    cidr text DEFAULT ''::text NOT NULL,
    gateway text DEFAULT ''::text NOT NULL,
    dhcp boolean DEFAULT false NOT NULL,
    bridge text DEFAULT ''::text NOT NULL,
    hosts text DEFAULT '[]'::text NOT NULL,
    range_first bigint DEFAULT 0 NOT NULL,
    range_last bigint DEFAULT 0 NOT NULL,
    gateway_num bigint DEFAULT 0 NOT NULL,
    created_at timestamp without time zone NOT NULL,
    updated_at timestamp without time zone NOT NULL,
    allow text DEFAULT '[]'::text NOT NULL
);


--
-- Name: replicas; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.replicas (
    id text NOT NULL,
    started_at timestamp without time zone NOT NULL,
    heartbeat_at timestamp without time zone NOT NULL
);


--
-- Name: schema_migrations; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.schema_migrations (
    version bigint NOT NULL,
    name text NOT NULL,
    applied_at timestamp without time zone NOT NULL
);


--
-- Name: tokens; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.tokens (
    id text NOT NULL,
    name text NOT NULL,
    secret_sha256 text NOT NULL,
    scopes text NOT NULL,
    expires_at timestamp without time zone,
    last_used_at timestamp without time zone,
    created_at timestamp without time zone NOT NULL
);


--
-- Name: ui_session_revocations; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.ui_session_revocations (
    session_id text NOT NULL,
    expires_at bigint NOT NULL
);


--
-- Name: vm_labels; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.vm_labels (
    vm_id text NOT NULL,
    label_key text NOT NULL,
    label_value text NOT NULL
);


--
-- Name: vm_nics; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.vm_nics (
    vm_id text NOT NULL,
    nic_index integer NOT NULL,
    network text NOT NULL,
    mac_address text NOT NULL,
    address bigint
);


--
-- Name: vms; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.vms (
    id text NOT NULL,
    name text NOT NULL,
    host_name text NOT NULL,
    image text NOT NULL,
    vcpus bigint NOT NULL,
    memory_mib bigint NOT NULL,
    disk_mib bigint NOT NULL,
    power_state text NOT NULL,
    observed_state text NOT NULL,
    reason text DEFAULT ''::text NOT NULL,
    started_from text DEFAULT ''::text NOT NULL,
    holds_capacity boolean DEFAULT true NOT NULL,
    fork_id text,
    labels text DEFAULT '{}'::text NOT NULL,
    placement text DEFAULT ''::text NOT NULL,
    created_at timestamp without time zone NOT NULL,
    updated_at timestamp without time zone NOT NULL,
    fork_slot integer,
    nics text DEFAULT '[]'::text NOT NULL,
    constraints text DEFAULT ''::text NOT NULL,
    group_name text DEFAULT ''::text NOT NULL,
    spread_by text DEFAULT ''::text NOT NULL,
    spread_domain text DEFAULT ''::text NOT NULL,
    group_cap integer DEFAULT 0 NOT NULL,
    pending_vcpus bigint,
    pending_memory_mib bigint,
    resize_started_at timestamp without time zone,
    owner_replica text,
    guest text
);


--
-- Data for Name: deleted_vms; Type: TABLE DATA; Schema: public; Owner: -
--



--
-- Data for Name: forks; Type: TABLE DATA; Schema: public; Owner: -
--



--
-- Data for Name: group_domains; Type: TABLE DATA; Schema: public; Owner: -
--



--
-- Data for Name: hosts; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.hosts VALUES ('host-a', '127.0.0.1:1', '{}', true, true, 0, '2026-12-02 18:25:35.835051', '', '', '["img"]', 1, 0, 16, 32768, 100000, 16, 32768, 100000, 8, 5120, 10240, '[]', '2026-12-02 18:25:35.835051', '2026-12-02 18:25:35.835051', '', 0, 0, 0, '', NULL);
INSERT INTO public.hosts VALUES ('host-b', '127.0.0.1:1', '{}', true, true, 0, '2026-12-02 18:25:35.846561', '', '', '["img"]', 1, 0, 16, 32768, 100000, 16, 32768, 100000, 1, 512, 1024, '[]', '2026-12-02 18:25:35.846561', '2026-12-02 18:25:35.846561', '', 0, 0, 0, '', NULL);


--
-- Data for Name: idempotency_keys; Type: TABLE DATA; Schema: public; Owner: -
--



--
-- Data for Name: images; Type: TABLE DATA; Schema: public; Owner: -
--



--
-- Data for Name: networks; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.networks VALUES ('default', 'user', '', '', false, '', '[]', 0, 0, 0, '2026-12-02 18:25:35.0598', '2026-12-02 18:25:35.0598', '[]');


--
-- Data for Name: replicas; Type: TABLE DATA; Schema: public; Owner: -
--



--
-- Data for Name: schema_migrations; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.schema_migrations VALUES (1, '0001_init.sql', '2026-12-02 18:25:35.196561');
INSERT INTO public.schema_migrations VALUES (2, '0002_forks.sql', '2026-12-02 18:25:35.244158');
INSERT INTO public.schema_migrations VALUES (3, '0003_tokens.sql', '2026-12-02 18:25:35.349457');
INSERT INTO public.schema_migrations VALUES (4, '0004_host_identity.sql', '2026-12-02 18:25:35.367811');
INSERT INTO public.schema_migrations VALUES (5, '0005_networks.sql', '2026-12-02 18:25:35.510862');
INSERT INTO public.schema_migrations VALUES (6, '0006_placement_groups.sql', '2026-12-02 18:25:35.569115');
INSERT INTO public.schema_migrations VALUES (7, '0007_resize.sql', '2026-12-02 18:25:35.571887');
INSERT INTO public.schema_migrations VALUES (8, '0008_images.sql', '2026-12-02 18:25:35.626818');
INSERT INTO public.schema_migrations VALUES (9, '0009_replica_leases.sql', '2026-12-02 18:25:35.763382');
INSERT INTO public.schema_migrations VALUES (10, '0010_guest_config.sql', '2026-12-02 18:25:35.766041');
INSERT INTO public.schema_migrations VALUES (11, '0011_warm_capacity_retire.sql', '2026-12-02 18:25:35.773178');
INSERT INTO public.schema_migrations VALUES (12, '0012_network_allow.sql', '2026-12-02 18:25:35.774036');
INSERT INTO public.schema_migrations VALUES (13, '0013_idempotency_scope.sql', '2026-12-02 18:25:35.822585');


--
-- Data for Name: tokens; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.tokens VALUES ('tok-admin', 'ops', 'aa', '["admin"]', NULL, NULL, '2026-12-02 18:25:35.890253');
INSERT INTO public.tokens VALUES ('tok-user', 'ci', 'bb', '["user"]', NULL, NULL, '2026-12-02 18:25:35.894275');
INSERT INTO public.tokens VALUES ('tok-both', 'all', 'cc', '["admin","user"]', NULL, NULL, '2026-12-02 18:25:35.895184');


--
-- Data for Name: ui_session_revocations; Type: TABLE DATA; Schema: public; Owner: -
--



--
-- Data for Name: vm_labels; Type: TABLE DATA; Schema: public; Owner: -
--



--
-- Data for Name: vm_nics; Type: TABLE DATA; Schema: public; Owner: -
--



--
-- Data for Name: vms; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.vms VALUES ('vm-1', 'web-1', 'host-a', 'img', 2, 1024, 2048, 'running', 'running', '', '', true, NULL, '{}', '', '2026-12-02 18:25:35.849616', '2026-12-02 18:25:35.849616', NULL, '[]', '', '', '', '', 0, NULL, NULL, NULL, NULL, NULL);
INSERT INTO public.vms VALUES ('vm-2', 'web-2', 'host-b', 'img', 1, 512, 1024, 'running', 'running', '', '', true, NULL, '{}', '', '2026-12-02 18:25:35.863914', '2026-12-02 18:25:35.863914', NULL, '[]', '', '', '', '', 0, NULL, NULL, NULL, NULL, NULL);
INSERT INTO public.vms VALUES ('vm-3', 'db', 'host-a', 'img', 4, 4096, 8192, 'running', 'running', '', '', true, NULL, '{}', '', '2026-12-02 18:25:35.866437', '2026-12-02 18:25:35.869119', NULL, '[]', '', '', '', '', 0, 6, 4096, '2026-12-02 18:25:35.869119', NULL, NULL);
INSERT INTO public.vms VALUES ('vm-4', 'gone', 'host-b', 'img', 8, 8192, 4096, 'running', 'missing', 'gone from its host', '', false, NULL, '{}', '', '2026-12-02 18:25:35.86761', '2026-12-02 18:25:35.886616', NULL, '[]', '', '', '', '', 0, NULL, NULL, NULL, NULL, NULL);


--
-- Name: deleted_vms deleted_vms_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.deleted_vms
    ADD CONSTRAINT deleted_vms_pkey PRIMARY KEY (vm_id);


--
-- Name: forks forks_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.forks
    ADD CONSTRAINT forks_pkey PRIMARY KEY (id);


--
-- Name: group_domains group_domains_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.group_domains
    ADD CONSTRAINT group_domains_pkey PRIMARY KEY (group_name, spread_by, domain);


--
-- Name: hosts hosts_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.hosts
    ADD CONSTRAINT hosts_pkey PRIMARY KEY (name);


--
-- Name: idempotency_keys idempotency_keys_scoped_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.idempotency_keys
    ADD CONSTRAINT idempotency_keys_scoped_pkey PRIMARY KEY (scope, caller, idem_key);


--
-- Name: images images_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.images
    ADD CONSTRAINT images_pkey PRIMARY KEY (name);


--
-- Name: networks networks_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.networks
    ADD CONSTRAINT networks_pkey PRIMARY KEY (name);


--
-- Name: replicas replicas_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.replicas
    ADD CONSTRAINT replicas_pkey PRIMARY KEY (id);


--
-- Name: schema_migrations schema_migrations_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.schema_migrations
    ADD CONSTRAINT schema_migrations_pkey PRIMARY KEY (version);


--
-- Name: tokens tokens_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.tokens
    ADD CONSTRAINT tokens_pkey PRIMARY KEY (id);


--
-- Name: ui_session_revocations ui_session_revocations_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.ui_session_revocations
    ADD CONSTRAINT ui_session_revocations_pkey PRIMARY KEY (session_id);


--
-- Name: vm_labels vm_labels_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.vm_labels
    ADD CONSTRAINT vm_labels_pkey PRIMARY KEY (vm_id, label_key);


--
-- Name: vm_nics vm_nics_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.vm_nics
    ADD CONSTRAINT vm_nics_pkey PRIMARY KEY (vm_id, nic_index);


--
-- Name: vms vms_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.vms
    ADD CONSTRAINT vms_pkey PRIMARY KEY (id);


--
-- Name: forks_idempotency_key; Type: INDEX; Schema: public; Owner: -
--

CREATE UNIQUE INDEX forks_idempotency_key ON public.forks USING btree (idempotency_caller, idempotency_key) WHERE (idempotency_key IS NOT NULL);


--
-- Name: forks_phase; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX forks_phase ON public.forks USING btree (phase);


--
-- Name: hosts_agent_key; Type: INDEX; Schema: public; Owner: -
--

CREATE UNIQUE INDEX hosts_agent_key ON public.hosts USING btree (agent_key) WHERE (agent_key <> ''::text);


--
-- Name: idempotency_keys_expires_at; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX idempotency_keys_expires_at ON public.idempotency_keys USING btree (expires_at);


--
-- Name: images_sha256; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX images_sha256 ON public.images USING btree (sha256);


--
-- Name: tokens_secret_sha256; Type: INDEX; Schema: public; Owner: -
--

CREATE UNIQUE INDEX tokens_secret_sha256 ON public.tokens USING btree (secret_sha256);


--
-- Name: ui_session_revocations_expires_at; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX ui_session_revocations_expires_at ON public.ui_session_revocations USING btree (expires_at);


--
-- Name: vm_labels_key_value; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX vm_labels_key_value ON public.vm_labels USING btree (label_key, label_value, vm_id);


--
-- Name: vm_nics_address; Type: INDEX; Schema: public; Owner: -
--

CREATE UNIQUE INDEX vm_nics_address ON public.vm_nics USING btree (network, address);


--
-- Name: vm_nics_mac; Type: INDEX; Schema: public; Owner: -
--

CREATE UNIQUE INDEX vm_nics_mac ON public.vm_nics USING btree (mac_address);


--
-- Name: vms_fork_id; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX vms_fork_id ON public.vms USING btree (fork_id, id) WHERE (fork_id IS NOT NULL);


--
-- Name: vms_fork_slot; Type: INDEX; Schema: public; Owner: -
--

CREATE UNIQUE INDEX vms_fork_slot ON public.vms USING btree (fork_id, fork_slot) WHERE ((fork_id IS NOT NULL) AND (fork_slot IS NOT NULL));


--
-- Name: vms_host_name; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX vms_host_name ON public.vms USING btree (host_name, id);


--
-- Name: vms_image; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX vms_image ON public.vms USING btree (image);


--
-- Name: vms_name; Type: INDEX; Schema: public; Owner: -
--

CREATE UNIQUE INDEX vms_name ON public.vms USING btree (name);


--
-- Name: vm_labels vm_labels_vm_id_fkey; Type: FK CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.vm_labels
    ADD CONSTRAINT vm_labels_vm_id_fkey FOREIGN KEY (vm_id) REFERENCES public.vms(id) ON DELETE CASCADE;


--
-- Name: vm_nics vm_nics_vm_id_fkey; Type: FK CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.vm_nics
    ADD CONSTRAINT vm_nics_vm_id_fkey FOREIGN KEY (vm_id) REFERENCES public.vms(id) ON DELETE CASCADE;


--
-- Name: vms vms_host_name_fkey; Type: FK CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.vms
    ADD CONSTRAINT vms_host_name_fkey FOREIGN KEY (host_name) REFERENCES public.hosts(name);


--
-- PostgreSQL database dump complete
--


