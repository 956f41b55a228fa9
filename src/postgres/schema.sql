-- tower-lock's PostgreSQL schema, version 2: three tables and the functions that the
-- PostgresBackend calls, one per primitive, each run as one statement (no transaction
-- stays open while a lock is held). Version 2 added the idempotency records
-- (tower_lock_records, tower_lock_record_store); running this file upgrades version 1.
--
-- Run it once per database (psql -f schema.sql), or let PostgresBackend::builder(..)
-- .migrate() do it at build. It is idempotent: tables are created if missing and functions
-- replaced. The backend with another table name runs this text with `tower_lock` replaced
-- by that name (PostgresBackend::schema_sql(table) prints it).
--
-- Every table, function and query name here starts with `tower_lock`, so that the text
-- made for another table name collides with nothing of the user's.
--
-- Every function takes the row of its lock name FOR UPDATE first, so the operations on
-- one name run one after another, and reads what it needs after that, when every
-- earlier operation on the name has committed. Times are the server's clock
-- (clock_timestamp()), never the application's. Replies are arrays of bigint, the first
-- element saying what happened (see each function).

SELECT pg_advisory_xact_lock(hashtext('tower_lock schema'));

-- One row per lock (or semaphore) name while it is held, waited for, or its fencing
-- counter is kept: deleted by tower_lock_sweep once free for the fence retention.
CREATE TABLE IF NOT EXISTS tower_lock (
    name         text PRIMARY KEY,
    -- The exclusive holder and its re-entry count; NULL: none.
    owner        text,
    count        integer NOT NULL DEFAULT 0,
    -- The end of the exclusive holder's lease.
    expires      timestamptz,
    -- The fencing token of the last exclusive hold (shared holds carry it).
    token        bigint NOT NULL DEFAULT 0,
    -- The highest token issued or reserved for the name: the next one is above it.
    fence        bigint NOT NULL DEFAULT 0,
    -- Release ids of the holder's re-entries given back (a retried release is a no-op).
    undone       text[] NOT NULL DEFAULT '{}',
    -- Shared holders and registered waiting writers in tower_lock_holders.
    readers      integer NOT NULL DEFAULT 0,
    writers      integer NOT NULL DEFAULT 0,
    -- The last other instance that waits for the name, and until when: a run of one
    -- instance's holders ends by freeing the lock for it.
    waiter       text,
    waiter_until timestamptz,
    -- The last acquisition or final release.
    touched      timestamptz NOT NULL DEFAULT clock_timestamp()
) WITH (fillfactor = 70);

-- Holders with a lease of their own: shared holds ('s', holder 'r:' || owner), semaphore
-- permits ('p'), and writers waiting for shared holders to leave ('w', until the end of
-- their wait; new shared holds queue behind them).
CREATE TABLE IF NOT EXISTS tower_lock_holders (
    name    text NOT NULL,
    holder  text NOT NULL,
    kind    "char" NOT NULL,
    count   integer NOT NULL DEFAULT 1,
    token   bigint NOT NULL DEFAULT 0,
    expires timestamptz NOT NULL,
    undone  text[] NOT NULL DEFAULT '{}',
    PRIMARY KEY (name, holder)
) WITH (fillfactor = 70);

-- IdempotencyLayer's records: the response stored for a lock name by the hold that ran
-- the handler (tower_lock_record_store), replayed until `expires`; deleted by
-- tower_lock_sweep once expired.
CREATE TABLE IF NOT EXISTS tower_lock_records (
    name    text PRIMARY KEY,
    record  bytea NOT NULL,
    expires timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS tower_lock_records_exp ON tower_lock_records (expires);

CREATE OR REPLACE FUNCTION tower_lock_schema_version() RETURNS integer
LANGUAGE sql IMMUTABLE AS $$ SELECT 2 $$;

-- Milliseconds from `a` until `b`, rounded up (at least 0).
CREATE OR REPLACE FUNCTION tower_lock_ms(a timestamptz, b timestamptz) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
    SELECT greatest(0, ceil(extract(epoch FROM b - a) * 1000))::bigint
$$;

-- The row of `p_name`, locked for the rest of the statement, created if missing.
CREATE OR REPLACE FUNCTION tower_lock_row(p_name text) RETURNS tower_lock
LANGUAGE plpgsql AS $$
DECLARE
    l tower_lock;
BEGIN
    SELECT * INTO l FROM tower_lock WHERE name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO tower_lock (name) VALUES (p_name) ON CONFLICT (name) DO NOTHING;
        SELECT * INTO l FROM tower_lock WHERE name = p_name FOR UPDATE;
    END IF;
    RETURN l;
END
$$;

-- Drops the holders of `p_kind` of `p_name` whose lease ended; returns how many are left
-- and when the first of their leases ends. The caller holds the name's row.
CREATE OR REPLACE FUNCTION tower_lock_prune(p_name text, p_kind "char", p_now timestamptz,
    OUT live integer, OUT earliest timestamptz)
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM tower_lock_holders
    WHERE name = p_name AND kind = p_kind AND expires <= p_now;
    SELECT count(*), min(expires) INTO live, earliest
    FROM tower_lock_holders WHERE name = p_name AND kind = p_kind;
END
$$;

-- Takes or re-enters the exclusive lock of `p_name` for `p_holder`.
-- p_wait_ms: how long the caller still waits (0: not at all); p_reserve: tokens to reserve
-- above a new hold's own; p_yielding: leave a free lock to another instance that waits;
-- p_instance: the caller's instance id.
-- Returns {1, token, count} (count > 1: a re-entry), {0, ms} when held by another (ms: its
-- lease left), {0, ms, 1} when kept out by shared holders and registered as a waiting
-- writer (ms: until the first shared lease ends), {4} when the holder holds it shared (no
-- upgrade), {5} when left to another instance.
CREATE OR REPLACE FUNCTION tower_lock_acquire(p_name text, p_holder text, p_lease_ms bigint,
    p_wait_ms bigint, p_reserve bigint, p_yielding boolean, p_instance text)
RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    t_now timestamptz := clock_timestamp();
    lease interval := p_lease_ms * interval '1 millisecond';
    l tower_lock;
    live integer;
    earliest timestamptz;
    new_token bigint;
BEGIN
    l := tower_lock_row(p_name);
    IF l.owner = p_holder AND l.expires > t_now THEN
        UPDATE tower_lock
        SET count = count + 1, expires = greatest(expires, t_now + lease)
        WHERE name = p_name;
        RETURN ARRAY[1, l.token, l.count + 1];
    END IF;
    IF l.owner IS NOT NULL AND l.expires > t_now THEN
        IF p_wait_ms > 0 AND (l.waiter IS DISTINCT FROM p_instance
                OR l.waiter_until < t_now + p_wait_ms * interval '1 millisecond' / 2) THEN
            UPDATE tower_lock
            SET waiter = p_instance, waiter_until = t_now + p_wait_ms * interval '1 millisecond'
            WHERE name = p_name;
        END IF;
        RETURN ARRAY[0, tower_lock_ms(t_now, l.expires)];
    END IF;
    IF l.readers > 0 THEN
        IF EXISTS (SELECT 1 FROM tower_lock_holders WHERE name = p_name
                AND holder = 'r:' || p_holder AND expires > t_now) THEN
            RETURN ARRAY[4];
        END IF;
        SELECT * INTO live, earliest FROM tower_lock_prune(p_name, 's', t_now);
        UPDATE tower_lock SET readers = live WHERE name = p_name;
        IF live > 0 THEN
            IF p_wait_ms = 0 THEN
                RETURN ARRAY[0, tower_lock_ms(t_now, (SELECT max(expires)
                    FROM tower_lock_holders WHERE name = p_name AND kind = 's'))];
            END IF;
            INSERT INTO tower_lock_holders AS h (name, holder, kind, count, expires)
            VALUES (p_name, p_holder, 'w', 0, t_now + p_wait_ms * interval '1 millisecond')
            ON CONFLICT (name, holder) DO UPDATE SET expires = EXCLUDED.expires;
            UPDATE tower_lock SET writers = (SELECT count(*) FROM tower_lock_holders
                WHERE name = p_name AND kind = 'w') WHERE name = p_name;
            RETURN ARRAY[0, tower_lock_ms(t_now, earliest), 1];
        END IF;
    END IF;
    IF p_yielding AND l.waiter IS NOT NULL AND l.waiter <> p_instance
            AND l.waiter_until > t_now THEN
        RETURN ARRAY[5];
    END IF;
    new_token := greatest(l.fence + 1, (extract(epoch FROM t_now) * 1000000)::bigint);
    IF l.writers > 0 THEN
        DELETE FROM tower_lock_holders WHERE name = p_name AND holder = p_holder AND kind = 'w';
        UPDATE tower_lock SET writers = (SELECT count(*) FROM tower_lock_holders
            WHERE name = p_name AND kind = 'w') WHERE name = p_name;
    END IF;
    UPDATE tower_lock
    SET owner = p_holder, count = 1, expires = t_now + lease, token = new_token,
        fence = new_token + p_reserve, undone = '{}', touched = t_now,
        waiter = CASE WHEN waiter = p_instance THEN NULL ELSE waiter END
    WHERE name = p_name;
    RETURN ARRAY[1, new_token, 1];
END
$$;

-- Gives back one exclusive hold of `p_name` by `p_holder`, idempotently per p_release_id,
-- or hands the lock to p_successor (a task of the same process).
-- p_only_token: act only on the hold of this token (NULL: any); p_retried: an earlier call
-- of this release may have run; p_run_spent: the holder's process had its turn, so free
-- the lock if another instance waits; p_issued: the last token the process issued in
-- memory under this hold (NULL: none); p_reserve: tokens to reserve for the successor.
-- Returns {3, token} when handed to the successor under a new token, {2} when freed (and
-- NOTIFY sent on p_channel), {1} when an outer hold remains (or this one was already given
-- back), {0} when the holder does not hold the lock.
CREATE OR REPLACE FUNCTION tower_lock_release(p_name text, p_holder text, p_release_id text,
    p_lease_ms bigint, p_channel text, p_only_token bigint, p_retried boolean,
    p_successor text, p_successor_lease_ms bigint, p_run_spent boolean, p_issued bigint,
    p_reserve bigint, p_instance text)
RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    t_now timestamptz := clock_timestamp();
    l tower_lock;
    last_token bigint;
BEGIN
    SELECT * INTO l FROM tower_lock WHERE name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN ARRAY[0];
    END IF;
    IF p_release_id = ANY (l.undone) THEN
        RETURN ARRAY[1];
    END IF;
    IF p_retried AND p_successor IS NOT NULL AND l.owner = p_successor
            AND l.expires > t_now THEN
        RETURN ARRAY[3, l.token];
    END IF;
    IF l.owner IS DISTINCT FROM p_holder OR l.expires <= t_now
            OR (p_only_token IS NOT NULL AND l.token <> p_only_token) THEN
        RETURN ARRAY[0];
    END IF;
    IF l.count > 1 THEN
        UPDATE tower_lock
        SET count = count - 1, undone = undone || p_release_id,
            expires = greatest(expires, t_now + p_lease_ms * interval '1 millisecond')
        WHERE name = p_name;
        RETURN ARRAY[1];
    END IF;
    last_token := coalesce(p_issued, l.token);
    IF p_successor IS NOT NULL AND NOT (p_run_spent AND l.waiter IS NOT NULL
            AND l.waiter <> p_instance AND l.waiter_until > t_now)
            AND NOT (l.readers > 0 AND EXISTS (SELECT 1 FROM tower_lock_holders
                WHERE name = p_name AND holder = 'r:' || p_holder AND expires > t_now)) THEN
        UPDATE tower_lock
        SET owner = p_successor, count = 1, token = last_token + 1,
            fence = last_token + 1 + p_reserve, undone = '{}', touched = t_now,
            expires = t_now + p_successor_lease_ms * interval '1 millisecond'
        WHERE name = p_name;
        RETURN ARRAY[3, last_token + 1];
    END IF;
    -- Freed, or left to the holder's own shared hold (a downgrade): waiters are told when
    -- the statement commits.
    UPDATE tower_lock
    SET owner = NULL, count = 0, expires = NULL, undone = '{}', token = last_token,
        fence = greatest(fence, last_token), touched = t_now
    WHERE name = p_name;
    PERFORM pg_notify(p_channel, '');
    RETURN ARRAY[2];
END
$$;

-- Extends (never shortens) the leases of a batch of holds, and says for each whether its
-- holder still holds it: an exclusive hold (tower_lock.owner) or a holder with its own
-- lease. A lease of 0 only checks.
CREATE OR REPLACE FUNCTION tower_lock_renew(p_names text[], p_holders text[],
    p_leases bigint[])
RETURNS boolean[]
LANGUAGE sql AS $$
    WITH tower_lock_batch AS (
        SELECT * FROM unnest(p_names, p_holders, p_leases) WITH ORDINALITY
            AS b(name, holder, lease, i)
    ), tower_lock_renewed AS (
        UPDATE tower_lock l
        SET expires = greatest(l.expires, clock_timestamp() + b.lease * interval '1 millisecond')
        FROM tower_lock_batch b
        WHERE l.name = b.name AND l.owner = b.holder AND l.expires > clock_timestamp()
            AND b.lease > 0
        RETURNING b.i
    ), tower_lock_renewed_holders AS (
        UPDATE tower_lock_holders h
        SET expires = greatest(h.expires, clock_timestamp() + b.lease * interval '1 millisecond')
        FROM tower_lock_batch b
        WHERE h.name = b.name AND h.holder = b.holder AND h.kind IN ('s', 'p')
            AND h.expires > clock_timestamp() AND b.lease > 0
        RETURNING b.i
    ), tower_lock_checked AS (
        SELECT b.i FROM tower_lock_batch b
        WHERE b.lease = 0 AND (
            EXISTS (SELECT 1 FROM tower_lock l WHERE l.name = b.name AND l.owner = b.holder
                AND l.expires > clock_timestamp())
            OR EXISTS (SELECT 1 FROM tower_lock_holders h WHERE h.name = b.name
                AND h.holder = b.holder AND h.kind IN ('s', 'p')
                AND h.expires > clock_timestamp()))
    )
    SELECT coalesce(array_agg(b.i IN (SELECT i FROM tower_lock_renewed
        UNION ALL SELECT i FROM tower_lock_renewed_holders
        UNION ALL SELECT i FROM tower_lock_checked) ORDER BY b.i), '{}')
    FROM tower_lock_batch b
$$;

-- Takes or re-enters a shared hold of `p_name`'s read/write lock for p_holder ('r:' ||
-- p_owner). Returns {1, token, count} (token: the last exclusive hold's), or {0, ms} when
-- a writer holds it or waits for it (ms: its lease or wait left).
CREATE OR REPLACE FUNCTION tower_lock_shared_acquire(p_name text, p_holder text,
    p_owner text, p_lease_ms bigint)
RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    t_now timestamptz := clock_timestamp();
    lease interval := p_lease_ms * interval '1 millisecond';
    l tower_lock;
    h tower_lock_holders;
    live integer;
    earliest timestamptz;
BEGIN
    l := tower_lock_row(p_name);
    SELECT * INTO h FROM tower_lock_holders WHERE name = p_name AND holder = p_holder;
    IF FOUND AND h.expires > t_now THEN
        UPDATE tower_lock_holders
        SET count = count + 1, expires = greatest(expires, t_now + lease)
        WHERE name = p_name AND holder = p_holder;
        RETURN ARRAY[1, l.token, h.count + 1];
    END IF;
    IF FOUND THEN
        DELETE FROM tower_lock_holders WHERE name = p_name AND holder = p_holder;
    END IF;
    IF l.owner IS NOT NULL AND l.expires > t_now THEN
        IF l.owner <> p_owner THEN
            RETURN ARRAY[0, tower_lock_ms(t_now, l.expires)];
        END IF;
        -- The writer itself: a downgrade, let in whoever waits.
    ELSIF l.writers > 0 THEN
        SELECT * INTO live, earliest FROM tower_lock_prune(p_name, 'w', t_now);
        UPDATE tower_lock SET writers = live WHERE name = p_name;
        IF live > 0 THEN
            RETURN ARRAY[0, tower_lock_ms(t_now, earliest)];
        END IF;
    END IF;
    INSERT INTO tower_lock_holders (name, holder, kind, count, token, expires)
    VALUES (p_name, p_holder, 's', 1, l.token, t_now + lease);
    UPDATE tower_lock SET touched = t_now, readers = (SELECT count(*) FROM tower_lock_holders
        WHERE name = p_name AND kind = 's') WHERE name = p_name;
    RETURN ARRAY[1, l.token, 1];
END
$$;

-- Takes or re-enters one of p_permits permits of the semaphore `p_name` for p_holder.
-- Returns {1, token, count}, or {0, ms} when all are taken (ms: until the first holder's
-- lease ends).
CREATE OR REPLACE FUNCTION tower_lock_permit_acquire(p_name text, p_holder text,
    p_lease_ms bigint, p_permits integer)
RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    t_now timestamptz := clock_timestamp();
    lease interval := p_lease_ms * interval '1 millisecond';
    l tower_lock;
    h tower_lock_holders;
    live integer;
    earliest timestamptz;
    new_token bigint;
BEGIN
    l := tower_lock_row(p_name);
    SELECT * INTO h FROM tower_lock_holders WHERE name = p_name AND holder = p_holder;
    IF FOUND AND h.expires > t_now THEN
        UPDATE tower_lock_holders
        SET count = count + 1, expires = greatest(expires, t_now + lease)
        WHERE name = p_name AND holder = p_holder;
        RETURN ARRAY[1, h.token, h.count + 1];
    END IF;
    SELECT * INTO live, earliest FROM tower_lock_prune(p_name, 'p', t_now);
    IF live >= p_permits THEN
        RETURN ARRAY[0, tower_lock_ms(t_now, earliest)];
    END IF;
    new_token := greatest(l.fence + 1, (extract(epoch FROM t_now) * 1000000)::bigint);
    UPDATE tower_lock SET fence = new_token, touched = t_now WHERE name = p_name;
    INSERT INTO tower_lock_holders (name, holder, kind, count, token, expires)
    VALUES (p_name, p_holder, 'p', 1, new_token, t_now + lease);
    RETURN ARRAY[1, new_token, 1];
END
$$;

-- Gives back one hold of a holder with its own lease (a shared hold, a permit),
-- idempotently per p_release_id. Returns {2} when the holder's hold ended (NOTIFY sent
-- when that frees a permit or the last shared hold), {1} when an outer hold remains (or
-- this one was already given back), {0} when the holder holds nothing (or under another
-- token than p_only_token).
CREATE OR REPLACE FUNCTION tower_lock_holder_release(p_name text, p_holder text,
    p_release_id text, p_lease_ms bigint, p_channel text, p_only_token bigint)
RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    t_now timestamptz := clock_timestamp();
    l tower_lock;
    h tower_lock_holders;
    live integer;
    earliest timestamptz;
BEGIN
    SELECT * INTO l FROM tower_lock WHERE name = p_name FOR UPDATE;
    SELECT * INTO h FROM tower_lock_holders WHERE name = p_name AND holder = p_holder;
    IF NOT FOUND THEN
        RETURN ARRAY[0];
    END IF;
    IF p_release_id = ANY (h.undone) THEN
        RETURN ARRAY[1];
    END IF;
    IF h.kind NOT IN ('s', 'p') OR h.expires <= t_now
            OR (p_only_token IS NOT NULL AND h.token <> p_only_token) THEN
        RETURN ARRAY[0];
    END IF;
    IF h.count > 1 THEN
        UPDATE tower_lock_holders
        SET count = count - 1, undone = undone || p_release_id,
            expires = greatest(expires, t_now + p_lease_ms * interval '1 millisecond')
        WHERE name = p_name AND holder = p_holder;
        RETURN ARRAY[1];
    END IF;
    DELETE FROM tower_lock_holders WHERE name = p_name AND holder = p_holder;
    IF h.kind = 'p' THEN
        UPDATE tower_lock SET touched = t_now WHERE name = p_name;
        PERFORM pg_notify(p_channel, '');
        RETURN ARRAY[2];
    END IF;
    SELECT * INTO live, earliest FROM tower_lock_prune(p_name, 's', t_now);
    UPDATE tower_lock SET readers = live, touched = t_now WHERE name = p_name;
    -- A downgraded writer's shared hold: its exclusive hold still keeps everyone out.
    IF live = 0 AND (l.owner IS NULL OR l.expires <= t_now) THEN
        PERFORM pg_notify(p_channel, '');
    END IF;
    RETURN ARRAY[2];
END
$$;

-- A snapshot of the lock (or, if p_semaphore, the semaphore) `p_name`, for operators:
-- {mode, holders, holds, lease, token}, mode 0 free, 1 exclusive, 2 shared, 3 permits;
-- lease: milliseconds the longest lease still runs, -1 when free; token: the highest
-- fencing token issued or reserved for the name (0: none). Never owner ids.
CREATE OR REPLACE FUNCTION tower_lock_snapshot(p_name text, p_semaphore boolean,
    p_now timestamptz)
RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    l tower_lock;
    n integer;
    total bigint;
    latest timestamptz;
    token bigint;
BEGIN
    SELECT * INTO l FROM tower_lock WHERE name = p_name;
    token := coalesce(l.fence, 0);
    SELECT count(*), coalesce(sum(count), 0), max(expires) INTO n, total, latest
    FROM tower_lock_holders
    WHERE name = p_name AND expires > p_now
        AND kind = CASE WHEN p_semaphore THEN 'p' ELSE 's' END;
    IF p_semaphore AND n > 0 THEN
        RETURN ARRAY[3, n, total, tower_lock_ms(p_now, latest), token];
    END IF;
    IF NOT p_semaphore AND l.owner IS NOT NULL AND l.expires > p_now THEN
        RETURN ARRAY[1, 1, l.count, tower_lock_ms(p_now, greatest(l.expires, latest)), token];
    END IF;
    IF NOT p_semaphore AND n > 0 THEN
        RETURN ARRAY[2, n, total, tower_lock_ms(p_now, latest), token];
    END IF;
    RETURN ARRAY[0, 0, 0, -1, token];
END
$$;

CREATE OR REPLACE FUNCTION tower_lock_inspect(p_name text, p_semaphore boolean)
RETURNS bigint[]
LANGUAGE sql AS $$ SELECT tower_lock_snapshot(p_name, p_semaphore, clock_timestamp()) $$;

-- Frees the lock (or, if p_semaphore, every permit of the semaphore) `p_name` whatever
-- holds it, an operator's action, and returns its snapshot from before. Fenced: the next
-- token is above the name's counter, which is at least every token issued or reserved.
-- The waiters are told on p_channel; every backend of the namespace on p_admin, so that
-- the holder re-checks its holds and finds this one lost. Waiting writers stay
-- registered: they still wait.
CREATE OR REPLACE FUNCTION tower_lock_force_release(p_name text, p_semaphore boolean,
    p_channel text, p_admin text)
RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    t_now timestamptz := clock_timestamp();
    freed bigint[];
BEGIN
    PERFORM 1 FROM tower_lock WHERE name = p_name FOR UPDATE;
    freed := tower_lock_snapshot(p_name, p_semaphore, t_now);
    IF freed[1] = 0 THEN
        RETURN freed;
    END IF;
    IF p_semaphore THEN
        DELETE FROM tower_lock_holders WHERE name = p_name AND kind = 'p';
        UPDATE tower_lock SET touched = t_now WHERE name = p_name;
    ELSE
        DELETE FROM tower_lock_holders WHERE name = p_name AND kind = 's';
        UPDATE tower_lock
        SET owner = NULL, count = 0, expires = NULL, undone = '{}', readers = 0,
            touched = t_now
        WHERE name = p_name;
    END IF;
    PERFORM pg_notify(p_channel, '');
    PERFORM pg_notify(p_admin, '');
    RETURN freed;
END
$$;

-- Withdraws p_holder's registration as a waiting writer of `p_name` (it stopped waiting),
-- and wakes the name's waiters if p_wake (shared holds it kept out may come in).
CREATE OR REPLACE FUNCTION tower_lock_withdraw(p_name text, p_holder text, p_channel text,
    p_wake boolean)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM tower_lock WHERE name = p_name FOR UPDATE;
    DELETE FROM tower_lock_holders WHERE name = p_name AND holder = p_holder AND kind = 'w';
    IF FOUND THEN
        UPDATE tower_lock SET writers = (SELECT count(*) FROM tower_lock_holders
            WHERE name = p_name AND kind = 'w') WHERE name = p_name;
        IF p_wake THEN
            PERFORM pg_notify(p_channel, '');
        END IF;
    END IF;
END
$$;

-- Stores the idempotency record p_record for `p_name`, kept for p_retention_ms, if the hold
-- with the fencing token p_token still holds the name's lock, and replaces the name's
-- record, expired or not. The hold holds it while the lock is held, unexpired, under
-- p_token or a token below it: a hold passed between tasks of one process in memory keeps
-- the row's token, below the tokens of the tasks it was passed to, and any other hold
-- since (here or elsewhere) got a token above every token issued before it, p_token
-- included. Returns whether it stored the record.
CREATE OR REPLACE FUNCTION tower_lock_record_store(p_name text, p_token bigint,
    p_retention_ms bigint, p_record bytea)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    -- A force-release or release of the row in flight commits first: the row is read
    -- again once locked.
    PERFORM 1 FROM tower_lock
    WHERE name = p_name AND owner IS NOT NULL AND expires > clock_timestamp()
        AND token <= p_token
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    INSERT INTO tower_lock_records (name, record, expires)
    VALUES (p_name, p_record, clock_timestamp() + p_retention_ms * interval '1 millisecond')
    ON CONFLICT (name) DO UPDATE SET record = EXCLUDED.record, expires = EXCLUDED.expires;
    RETURN true;
END
$$;

-- Deletes up to p_limit names that nobody holds, waits for or used within the last
-- p_keep_ms (their fencing counters are no longer needed: a new token is never below the
-- clock in microseconds), with their expired holders, and up to p_limit expired records.
-- Returns how many names went, or how many records if more (p_limit: there may be more
-- left).
CREATE OR REPLACE FUNCTION tower_lock_sweep(p_keep_ms bigint, p_limit integer)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    t_now timestamptz := clock_timestamp();
    gone integer;
    records_gone integer;
BEGIN
    WITH tower_lock_doomed AS (
        SELECT name FROM tower_lock l
        WHERE touched < t_now - p_keep_ms * interval '1 millisecond'
            AND (owner IS NULL OR expires <= t_now)
            AND NOT EXISTS (SELECT 1 FROM tower_lock_holders h
                WHERE h.name = l.name AND h.expires > t_now)
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    ), tower_lock_doomed_holders AS (
        DELETE FROM tower_lock_holders h USING tower_lock_doomed d WHERE h.name = d.name
    )
    DELETE FROM tower_lock l USING tower_lock_doomed d WHERE l.name = d.name;
    GET DIAGNOSTICS gone = ROW_COUNT;
    DELETE FROM tower_lock_records WHERE name IN (SELECT name FROM tower_lock_records
        WHERE expires <= t_now LIMIT p_limit FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS records_gone = ROW_COUNT;
    RETURN greatest(gone, records_gone);
END
$$;
